/// Errors of tt-dist.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Some of a launcher's variables are set but not all.
    #[error("{source_name} variables are incomplete: {missing} missing; set them all (as torchrun or srun do), or none for a single process")]
    Missing {
        /// `torchrun` or `Slurm`.
        source_name: &'static str,
        /// The names missing.
        missing: String,
    },
    /// A variable holds something that is not what it should be.
    #[error("{name}={value:?} is {reason}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// The variables contradict each other.
    #[error("inconsistent distributed environment: {0}")]
    Inconsistent(String),
    /// A launch argument is wrong.
    #[error("{0}")]
    Launch(String),
    /// An OS error while launching.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with tt-dist's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
