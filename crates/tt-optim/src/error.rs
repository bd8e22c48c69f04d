/// Errors of tt-optim.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A hyper-parameter torch would refuse.
    #[error("invalid optimizer configuration: {reason}")]
    InvalidConfig {
        /// Which hyper-parameter, and why torch refuses it.
        reason: String,
    },
    /// libtorch failed in an update.
    #[error("tensor operation failed for {param:?}: {reason}")]
    Torch {
        /// The parameter.
        param: String,
        /// libtorch's message.
        reason: String,
    },
    /// A saved state that does not fit this optimizer.
    #[error("the saved optimizer state does not fit: {reason}")]
    StateMismatch {
        /// What differs.
        reason: String,
    },
    /// Reading or writing the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] tt_ckpt::Error),
}

/// `Result` with tt-optim's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
