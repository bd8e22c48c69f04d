use std::time::Duration;

/// Why a probe failed. Each carries what the child printed last on stderr.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The child could not be started.
    #[error("cannot start the probe {what}: {reason}")]
    Spawn {
        /// The program or probe.
        what: String,
        /// Why.
        reason: String,
    },
    /// The probe ran out of memory.
    #[error("the probe ran out of memory: {reason}; the job cannot run at this size on this device\n--- last stderr ---\n{stderr_tail}")]
    OutOfMemory {
        /// The out-of-memory error's text.
        reason: String,
        /// The end of the child's stderr.
        stderr_tail: String,
    },
    /// The child exited with a failure status.
    #[error("the probe exited with status {code}\n--- last stderr ---\n{stderr_tail}")]
    Failed {
        /// The exit status.
        code: i32,
        /// The end of the child's stderr.
        stderr_tail: String,
    },
    /// The child was killed by a signal (a crash, or the kernel's OOM killer).
    #[error("the probe was killed by signal {signal}{hint}\n--- last stderr ---\n{stderr_tail}")]
    Crashed {
        /// The signal.
        signal: i32,
        /// "(SIGKILL: the OOM killer?)" and the like.
        hint: String,
        /// The end of the child's stderr.
        stderr_tail: String,
    },
    /// The child did not finish in time; it (and its process group) was killed.
    #[error("the probe did not finish within {limit:?} and was killed; raise the timeout or lower the probe's steps\n--- last stderr ---\n{stderr_tail}")]
    Timeout {
        /// The limit.
        limit: Duration,
        /// The end of the child's stderr.
        stderr_tail: String,
    },
    /// The child exited normally but sent no report.
    #[error("the probe child exited without a report: {hint}\n--- last stderr ---\n{stderr_tail}")]
    NoReport {
        /// What is probably missing.
        hint: String,
        /// The end of the child's stderr.
        stderr_tail: String,
    },
    /// The largest batch cannot be predicted from the probes (named in the text).
    #[error("cannot predict the largest batch: {reason}")]
    NoBatchGrowth {
        /// What the probes showed.
        reason: String,
    },
}

/// `Result` with tt-probe's [`ProbeError`].
pub type Result<T, E = ProbeError> = std::result::Result<T, E>;
