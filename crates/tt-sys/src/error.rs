//! The errors of tt-sys: libtorch's exceptions caught at the C boundary, and why CUDA
//! cannot be used (a leaf: every module returns them).

use std::path::PathBuf;

/// Why CUDA cannot be used from this process. Each variant's message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaUnavailable {
    /// `TORCHTOOLS_CUDA_PRELOAD` holds something other than `0` or `1`.
    #[error(
        "TORCHTOOLS_CUDA_PRELOAD={value:?} is not 0 or 1: set 0 to keep libtorch's CUDA \
         library from loading as the program starts, 1 (or unset it) for the default"
    )]
    BadPreload {
        /// The value.
        value: String,
    },
    /// The libtorch in use has no `libtorch_cuda.so`.
    #[error(
        "libtorch_cuda.so not found in {dir}: this libtorch is CPU-only; \
         point LIBTORCH at a CUDA build of libtorch 2.11.0 (the default PyPI torch==2.11.0 wheel is one)"
    )]
    CpuOnlyLibtorch {
        /// The directory libc10.so was loaded from.
        dir: PathBuf,
    },
    /// `dlopen` of `libtorch_cuda.so` failed (a CUDA runtime library is missing, ...).
    #[error("could not load {path}: {reason}")]
    LoadFailed {
        /// The library that failed to load.
        path: PathBuf,
        /// What `dlerror` said.
        reason: String,
    },
    /// The NVIDIA driver library (`libcuda.so.1`) cannot be loaded.
    #[error(
        "no NVIDIA driver: libcuda.so.1 cannot be loaded ({reason}); \
         install the NVIDIA driver, or use the CPU (TORCHTOOLS_DEVICE=cpu)"
    )]
    NoDriver {
        /// What `dlerror` said.
        reason: String,
    },
    /// The driver is there but no device is visible to this process.
    #[error("the NVIDIA driver is present but libtorch sees no CUDA device (CUDA_VISIBLE_DEVICES={visible})")]
    NoDevice {
        /// The value of `CUDA_VISIBLE_DEVICES`, or `<unset>`.
        visible: String,
    },
    /// The driver is older than the CUDA runtime this libtorch was built with.
    #[error(
        "the NVIDIA driver supports CUDA up to {driver_cuda} but this libtorch needs CUDA \
         {runtime_cuda} (CUDA 13 needs driver 580 or newer): update the driver, or point \
         LIBTORCH at a libtorch built for CUDA {driver_cuda} or older, or use the CPU \
         (TORCHTOOLS_DEVICE=cpu)"
    )]
    DriverTooOld {
        /// The newest CUDA the driver supports (`cuDriverGetVersion`), as `major.minor`.
        driver_cuda: String,
        /// The CUDA runtime of libtorch, as `major.minor`.
        runtime_cuda: String,
    },
    /// The driver sees GPUs but libtorch does not: libtorch was asked about CUDA before
    /// its CUDA library was loaded, and keeps that first answer for the process. tt-sys
    /// loads that library as the program starts, so this happens only with
    /// `TORCHTOOLS_CUDA_PRELOAD=0`.
    #[error(
        "the NVIDIA driver sees {driver_devices} GPU(s) but libtorch sees none: something asked \
         libtorch about CUDA (tch::Cuda::is_available, tch::manual_seed, ...) before libtorch's \
         CUDA library was loaded, and libtorch keeps that first answer; unset \
         TORCHTOOLS_CUDA_PRELOAD=0 (torchtools then loads it as the program starts), or call \
         torchtools::device::select() (or tt_sys::ensure_cuda_loaded()) first in main"
    )]
    QueriedTooEarly {
        /// The GPUs the driver API counts.
        driver_devices: usize,
    },
    /// libtorch raised an error while CUDA was being set up.
    #[error("libtorch could not set up CUDA: {reason}")]
    Torch {
        /// libtorch's message.
        reason: String,
    },
}

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// CUDA is not available in this process.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(CudaUnavailable),
    /// A device index at or beyond the number of visible devices.
    #[error("cuda:{device} does not exist: libtorch sees {count} CUDA device(s) (indices are logical, after CUDA_VISIBLE_DEVICES)")]
    DeviceOutOfRange {
        /// The index asked for.
        device: usize,
        /// How many devices are visible.
        count: usize,
    },
    /// libtorch raised a C++ exception; it was caught at the boundary.
    #[error("libtorch error in {op}: {reason}")]
    Torch {
        /// The operation that failed.
        op: &'static str,
        /// The exception's message.
        reason: String,
    },
}

// The reason is in the message; it is not also the `source()`, so that a chain
// printer (`{e:#}`) says it once.
impl From<CudaUnavailable> for Error {
    fn from(e: CudaUnavailable) -> Error {
        Error::CudaUnavailable(e)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
