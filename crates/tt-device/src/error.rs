use crate::env::{CUDA_VISIBLE_DEVICES, LOCAL_RANK, TORCHTOOLS_DEVICE};

/// Errors of tt-device. Each message names the variable, the value, what is
/// visible, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `TORCHTOOLS_DEVICE` holds something that is not a device.
    #[error(
        "{TORCHTOOLS_DEVICE}={value:?} is not a device: use one of auto, cpu, cuda, cuda:N \
         (N = 0, 1, ... after CUDA_VISIBLE_DEVICES), mps{hint}"
    )]
    InvalidDevice {
        /// The value given.
        value: String,
        /// A suggestion for a near miss, e.g. "; did you mean `cuda`?".
        hint: String,
    },
    /// `OMP_NUM_THREADS` is not a positive integer.
    #[error(
        "OMP_NUM_THREADS={value:?} is not a number of threads: give a positive integer \
         (e.g. 4), or unset it to use the CPUs this process may run on"
    )]
    InvalidOmpNumThreads {
        /// The value given.
        value: String,
    },
    /// `LOCAL_RANK` is not a non-negative integer.
    #[error(
        "{LOCAL_RANK}={value:?} is not a non-negative integer: launchers such as torchrun set it \
         to 0, 1, ... for each process on a node; unset it when not running under a launcher"
    )]
    InvalidLocalRank {
        /// The value given.
        value: String,
    },
    /// `CUDA_VISIBLE_DEVICES` has an entry that CUDA would silently stop at.
    #[error(
        "{CUDA_VISIBLE_DEVICES}={value:?} has the entry {entry:?}, which is neither a device index \
         nor a GPU-/MIG- UUID: CUDA would silently hide every device from there on; \
         write indices or UUIDs separated by commas (e.g. 0,1), or unset it"
    )]
    InvalidCudaVisibleDevices {
        /// The whole value.
        value: String,
        /// The offending entry.
        entry: String,
    },
    /// `cuda:N` with N at or past the number of visible devices.
    #[error(
        "{TORCHTOOLS_DEVICE}={requested:?} but {count} CUDA device(s) are visible \
         ({CUDA_VISIBLE_DEVICES}={visible}); {fix}"
    )]
    CudaIndexOutOfRange {
        /// The value of `TORCHTOOLS_DEVICE`.
        requested: String,
        /// Visible CUDA devices.
        count: usize,
        /// `CUDA_VISIBLE_DEVICES` as set, or `<unset>`.
        visible: String,
        /// What to do.
        fix: String,
    },
    /// `LOCAL_RANK` at or past the number of visible devices (with more than one).
    #[error(
        "{LOCAL_RANK}={local_rank} but only {count} CUDA devices are visible \
         ({CUDA_VISIBLE_DEVICES}={visible}): start at most {count} processes per node \
         (torchrun --nproc-per-node={count}), or give each process its own GPU \
         through CUDA_VISIBLE_DEVICES"
    )]
    LocalRankOutOfRange {
        /// The local rank.
        local_rank: usize,
        /// Visible CUDA devices.
        count: usize,
        /// `CUDA_VISIBLE_DEVICES` as set, or `<unset>`.
        visible: String,
    },
    /// CUDA was asked for but cannot be used.
    #[error(
        "{TORCHTOOLS_DEVICE}={requested:?} but CUDA is not usable: {reason}; \
         set {TORCHTOOLS_DEVICE}=cpu (or auto) to run on the CPU"
    )]
    CudaUnavailable {
        /// The value of `TORCHTOOLS_DEVICE`.
        requested: String,
        /// Why CUDA is not usable.
        reason: String,
    },
    /// MPS was asked for but cannot be used.
    #[error(
        "{TORCHTOOLS_DEVICE}=\"mps\" but MPS is not usable: {reason}; \
         set {TORCHTOOLS_DEVICE}=cpu (or auto) to run on the CPU"
    )]
    MpsUnavailable {
        /// Why MPS is not usable.
        reason: String,
    },
    /// A size such as `6GiB` could not be parsed.
    #[error("{value:?} is not a size: write a number with an optional unit, e.g. 512MiB, 6GiB, 1.5GB or 1048576")]
    InvalidSize {
        /// The text given.
        value: String,
    },
}

/// `Result` with tt-device's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
