#![doc = include_str!("../README.md")]
// The README shows a build script whole: its `fn main` is what users copy.
#![allow(clippy::needless_doctest_main)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod build;
#[cfg(test)]
mod cxx_cache;
#[cfg(test)]
mod nccl_header;

#[cfg(feature = "tch")]
mod autocast;
#[cfg(feature = "c10d")]
pub mod c10d;
#[cfg(feature = "tch")]
mod cuda;
#[cfg(feature = "tch")]
mod error;
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
    mem_get_info, reset_peak_stats, CudaInfo, DeviceStats, MemInfo, Stat,
};
#[cfg(feature = "tch")]
pub use error::{CudaUnavailable, Error, Result};
#[cfg(feature = "tch")]
pub use foreach::{foreach_adam, set_grads_none, AdamStep};
#[cfg(feature = "tch")]
pub use staging::{DeviceUploads, HostCopies};

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
