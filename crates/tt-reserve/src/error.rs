//! Why a reservation failed.

use tt_lock::GpuKey;

/// Why a reservation failed, or why a held one cannot do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Taking the GPU lock failed (busy past the timeout, bad GPU, lock directory).
    #[error("reserving a GPU: {0}")]
    Lock(tt_lock::Error),
    /// Raising the memory fence failed; the locks were released.
    #[error("reserving a GPU: {0}")]
    Fence(tt_fence::Error),
    /// The options contradict each other; nothing was taken.
    #[error("reserving a GPU: {reason}")]
    Options {
        /// Which options, and how to fix them.
        reason: String,
    },
    /// The fence needs to know which physical GPU to fence.
    #[error(
        "reserving a GPU: cannot fence {gpu}: without NVML the GPU's identity is unknown; \
         reserve with the lock alone (fence: false, or `torchtools reserve --no-fence`)"
    )]
    FenceWithoutNvml {
        /// The GPU locked.
        gpu: GpuKey,
    },
    /// A GPU is reserved but this process's CUDA driver does not show it (no driver,
    /// `CUDA_VISIBLE_DEVICES` hides it, or only its index lock is held): training on
    /// the CPU instead would silently give up the GPU that was waited for.
    #[error(
        "the reserved GPU {gpu} is not visible to CUDA in this process (no CUDA driver, \
         CUDA_VISIBLE_DEVICES hides it, or it is split into MIG instances, which CUDA names \
         by their own UUIDs and torchtools does not reserve yet); run where the driver sees \
         it, or reserve with `gpus: vec![GpuSpec::Auto]` to train on the CPU when the \
         machine has no GPU"
    )]
    NoCudaDevice {
        /// The GPU reserved.
        gpu: GpuKey,
    },
}

// The inner error is in the message; it is not also the `source()`, so that a chain
// printer (`{e:#}`) says it once.
impl From<tt_lock::Error> for Error {
    fn from(e: tt_lock::Error) -> Error {
        Error::Lock(e)
    }
}

impl From<tt_fence::Error> for Error {
    fn from(e: tt_fence::Error) -> Error {
        Error::Fence(e)
    }
}

impl Error {
    /// Whether it failed because the GPUs stayed held by someone else (past the timeout,
    /// or at once with `blocking: false`): try later, not a mistake in the request.
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            Error::Lock(
                tt_lock::Error::Timeout { .. }
                    | tt_lock::Error::WouldBlock { .. }
                    | tt_lock::Error::Held { .. }
            )
        )
    }

    /// Whether the request itself is wrong (an unknown or malformed GPU, contradicting
    /// options): fix the arguments.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            Error::Options { .. }
                | Error::Lock(
                    tt_lock::Error::InvalidGpu { .. }
                        | tt_lock::Error::UnknownGpu { .. }
                        | tt_lock::Error::Policy { .. }
                )
        )
    }
}
