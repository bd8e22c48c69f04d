//! The native layer of [torchtools]: the parts of libtorch that `tch` does not expose,
//! behind a small safe API, and a build-script helper for rpaths.
//!
//! - [`ensure_cuda_loaded`] makes CUDA usable in any binary linked through tch (whose
//!   `--as-needed` link otherwise drops `libtorch_cuda.so`, so that
//!   `tch::Cuda::is_available()` says false on a GPU machine), or says why it is not.
//! - [`device_stats`], [`empty_cache`], [`reset_peak_stats`] and [`mem_get_info`] read
//!   and steer libtorch's CUDA caching allocator, like `torch.cuda.memory_stats()`,
//!   `empty_cache()`, `reset_peak_memory_stats()` and `mem_get_info()`.
//! - [`build::link_libtorch_rpath`] gives a downstream binary an rpath to libtorch.
//!
//! Where an NVIDIA driver is (its device node exists), the shim loads
//! `libtorch_cuda.so` as the program starts, before `main`: libtorch otherwise answers a
//! first question about CUDA (`tch::Cuda::is_available()`, `tch::manual_seed`) from its
//! CPU-only stub and keeps "no GPU" for the process. `TORCHTOOLS_CUDA_PRELOAD=0` turns
//! that off. Loading the library registers libtorch's CUDA hooks; it creates no CUDA
//! context.
//!
//! What it does not do: it never initialises CUDA on its own (only the functions
//! above, when called, do), and it never prints. Every C++ exception is caught inside
//! the shim and comes back as an [`Error`]; nothing unwinds across `extern "C"`.
//!
//! Only [`build`] is compiled without the default `tch` feature; that part needs no
//! libtorch, so build scripts can use it.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "tch")] {
//! // On a machine without a GPU this reports why; on one with, it loads CUDA.
//! match tt_sys::ensure_cuda_loaded() {
//!     Ok(cuda) => {
//!         println!("{} CUDA device(s)", cuda.device_count);
//!         let stats = tt_sys::device_stats(0)?;
//!         println!("allocated now {} B, peak {} B", stats.allocated_bytes.current, stats.allocated_bytes.peak);
//!     }
//!     Err(why) => println!("CPU only: {why}"),
//! }
//! // Allocator calls without CUDA are errors, never crashes.
//! if tt_sys::ensure_cuda_loaded().is_err() {
//!     assert!(tt_sys::empty_cache().is_err());
//! }
//! println!("libtorch {}", tt_sys::libtorch_version());
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [torchtools]: https://docs.rs/torchtools
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod build;
#[cfg(test)]
mod nccl_header;

#[cfg(feature = "tch")]
mod autocast;
#[cfg(feature = "c10d")]
pub mod c10d;
#[cfg(feature = "tch")]
mod cuda;
#[cfg(feature = "tch")]
mod ffi;
#[cfg(feature = "tch")]
mod foreach;
#[cfg(feature = "tch")]
mod staging;

#[cfg(feature = "tch")]
pub use autocast::autocast;
#[cfg(feature = "tch")]
pub use cuda::{
    device_stats, empty_cache, ensure_cuda_loaded, libtorch_lib_dir, libtorch_version,
    mem_get_info, reset_peak_stats, CudaInfo, CudaUnavailable, DeviceStats, Error, MemInfo, Result,
    Stat,
};
#[cfg(feature = "tch")]
pub use foreach::{foreach_adam, set_grads_none, AdamStep};
#[cfg(feature = "tch")]
pub use staging::HostCopies;

/// For GPU-only tests: returns CUDA's info, or panics saying why CUDA is unusable.
///
/// GPU tests call this first, so that a run without a GPU fails loudly instead of
/// passing by luck. `cargo xtask test-gpu` selects those tests; the CPU matrix never
/// runs them.
#[cfg(feature = "tch")]
pub fn require_cuda() -> &'static CudaInfo {
    match ensure_cuda_loaded() {
        Ok(info) => info,
        Err(why) => panic!("this GPU test needs CUDA, which is unavailable: {why}"),
    }
}
