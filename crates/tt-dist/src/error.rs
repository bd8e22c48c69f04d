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
    #[error("inconsistent distributed environment: {reason}")]
    Inconsistent {
        /// Which variables, and how they disagree.
        reason: String,
    },
    /// A launch argument is wrong, or the launch cannot reach the first node: nothing
    /// was started.
    #[error("{reason}")]
    Launch {
        /// What is wrong, and the fix.
        reason: String,
    },
    /// A job of several nodes ended without a rank to blame: a node never joined, or a
    /// node's launcher was lost.
    #[error("{reason}")]
    Job {
        /// How the job ended.
        reason: String,
    },
    /// Forming the process group failed (store or backend); the message says what
    /// to check.
    #[error("rendezvous at {addr}:{port} failed: {reason}")]
    Rendezvous {
        /// `MASTER_ADDR`.
        addr: String,
        /// `MASTER_PORT`.
        port: u16,
        /// What c10d said, and the hint.
        reason: String,
    },
    /// The backend asked for is not in this build; nothing was contacted.
    #[error("the {backend} backend was asked for but this build has none: {fix}")]
    BackendUnavailable {
        /// `nccl` or `gloo`.
        backend: &'static str,
        /// How to get it, or what to use instead.
        fix: &'static str,
    },
    /// A collective failed: a peer died or hung past the timeout, or the tensors were
    /// wrong. The process group is unusable afterwards.
    #[error("{op} failed on rank {rank}: {reason}")]
    Collective {
        /// The collective.
        op: &'static str,
        /// This process's rank.
        rank: usize,
        /// What c10d said.
        reason: String,
    },
    /// A tensor operation around a collective failed (tch's error).
    #[error("{reason}")]
    Tensor {
        /// What libtorch said.
        reason: String,
    },
    /// A rank's program could not be started (not found, not executable, ...).
    #[error("cannot start rank {rank} ({program:?}): {cause}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program, as given.
        program: std::path::PathBuf,
        /// The OS error (its kind tells not found from not executable).
        cause: std::io::Error,
    },
    /// An OS error while launching.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error (in the message, so not also the `source()`).
        cause: std::io::Error,
    },
}

/// `Result` with tt-dist's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
