/// Errors of tt-fence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable CUDA driver: a machine without an NVIDIA GPU or driver.
    #[error(
        "cannot raise a GPU memory fence: {reason}; on a machine without an NVIDIA GPU, \
         reserve without a fence (--no-fence, or fence: false)"
    )]
    NoDriver {
        /// What the driver loader said.
        reason: String,
    },
    /// The GPU asked for is not visible to this process.
    #[error("cannot raise a GPU memory fence on {gpu}: {reason}")]
    NoSuchGpu {
        /// The GPU as given.
        gpu: String,
        /// Why.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed on cuda:{ordinal}: {reason}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The device.
        ordinal: usize,
        /// The driver's message.
        reason: String,
    },
}

/// `Result` with tt-fence's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
