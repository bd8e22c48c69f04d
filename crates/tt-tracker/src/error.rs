use std::path::PathBuf;

/// Errors of tt-tracker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A unit name that is not one of gpu_tracker's.
    #[error("{value:?} is not a {kind} unit: use one of {valid}")]
    InvalidUnit {
        /// The text given.
        value: String,
        /// RAM or time.
        kind: &'static str,
        /// The accepted names.
        valid: &'static str,
    },
    /// A summary statistic that is not one of gpu_tracker's.
    #[error("{value:?} is not a summary statistic: use one of min, max, mean, std")]
    InvalidStatistic {
        /// The text given.
        value: String,
    },
    /// An interval below the 10 ms minimum.
    #[error("a sampling interval of {given:?} is too short: the minimum is 10ms")]
    IntervalTooShort {
        /// The interval given.
        given: std::time::Duration,
    },
    /// The process to track does not exist.
    #[error("process {pid} does not exist (or has already exited); nothing to track")]
    NoSuchProcess {
        /// The pid given.
        pid: u32,
    },
    /// The timeline file has an extension we do not write.
    #[error(
        "cannot tell the timeline format of {path}: name it *.csv, *.jsonl (JSON Lines) or \
         *.sqlite"
    )]
    TimelineFormat {
        /// The path.
        path: PathBuf,
    },
    /// The timeline file exists and `overwrite` is off.
    #[error("the timeline file {path} already exists: remove it, or set overwrite")]
    TimelineExists {
        /// The path.
        path: PathBuf,
    },
    /// Writing the timeline failed.
    #[error("writing the timeline {path}: {reason}")]
    Timeline {
        /// The path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Drawing the plot failed.
    #[error("drawing {path}: {reason}")]
    Plot {
        /// The path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A variable of the Slurm job this process runs in that does not say what Slurm
    /// writes there (the job's CPUs or GPUs, the tracker's defaults inside a job).
    #[error("{0}")]
    Slurm(#[from] tt_device::SlurmError),
    /// A report file could not be read for a comparison.
    #[error("reading the tracking report {path}: {reason}")]
    Report {
        /// The path.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A tracking, sub-tracking or results file that cannot be analysed, combined
    /// or compared.
    #[error("{path}: {reason}")]
    SubTracking {
        /// The file.
        path: PathBuf,
        /// What is wrong, and the fix.
        reason: String,
    },
    /// The sampler thread panicked or could not start.
    #[error("the tracker's sampling thread failed: {reason}")]
    Sampler {
        /// What failed.
        reason: String,
    },
}

/// `Result` with tt-tracker's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
