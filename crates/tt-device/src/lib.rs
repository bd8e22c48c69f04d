//! Pick the device to train on, from the environment and what the machine and the
//! libtorch build can really use, and say why.
//!
//! tt-device is the bottom of [torchtools]. Its core needs no libtorch:
//!
//! - [`EnvConfig`] reads and checks `TORCHTOOLS_DEVICE` (`auto` | `cpu` | `cuda` |
//!   `cuda:N` | `mps`), `LOCAL_RANK` and `CUDA_VISIBLE_DEVICES`; every bad value is
//!   an [`Error`] naming the variable, the value, what is visible and the fix.
//! - [`Inventory`] lists the GPUs through NVML, loaded at run time (index, UUID,
//!   name, memory, processes). No NVML is a reported condition, not an error.
//! - [`select_with`] is the selection rule, pure, over an [`Availability`].
//! - [`CpuBudget`] says how many CPUs this process may really use (affinity mask,
//!   cgroup quota, `OMP_NUM_THREADS`): the intra-op thread count for libtorch.
//! - [`DeviceReport`] puts it together: text through `Display`, JSON through serde.
//!
//! With the `tch` feature (default), [`select`] returns a `tch::Device` in
//! libtorch's own view, after loading `libtorch_cuda.so` through tt-sys (so CUDA is
//! never missed because of how tch links), and [`report`] adds libtorch's version.
//! Unlike `tch::Device::cuda_if_available()`, nothing falls back silently: asking
//! for CUDA where it is unusable is an error that says why.
//!
//! # Example
//!
//! ```
//! use tt_device::{select_with, Availability, CudaCandidate, Bytes, Device, EnvConfig};
//!
//! // The environment of a torchrun worker, and a machine with two GPUs.
//! let env = EnvConfig::from_lookup(|name| match name {
//!     "LOCAL_RANK" => Some("1".into()),
//!     _ => None,
//! })?;
//! let two_gpus = Availability {
//!     cuda: Ok(vec![
//!         CudaCandidate { index: 0, free: Some(Bytes::gib(70)) },
//!         CudaCandidate { index: 1, free: Some(Bytes::gib(10)) },
//!     ]),
//!     mps: Err("not macOS".into()),
//! };
//! assert_eq!(select_with(&env, &two_gpus)?.device, Device::Cuda(1));
//!
//! // In a real process, with libtorch:
//! # #[cfg(feature = "tch")] {
//! let device: tch::Device = tt_device::select()?; // CPU here, CUDA on a GPU machine
//! let x = tch::Tensor::ones([2, 2], (tch::Kind::Float, device));
//! assert_eq!(x.sum(tch::Kind::Float).double_value(&[]), 4.0);
//! println!("{}", tt_device::report());
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [torchtools]: https://docs.rs/torchtools
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bytes;
mod cpu;
mod cuda;
mod duration;
mod env;
mod error;
mod inventory;
#[cfg(feature = "tch")]
mod libtorch;
mod report;
mod select;

pub use bytes::Bytes;
pub use cpu::{omp_num_threads, CpuBudget};
pub use cuda::{CudaDriver, CudaError};
pub use duration::parse_duration;
pub use env::{
    CudaVisibleDevices, DeviceRequest, EnvConfig, RawEnv, VisibleEntry, CUDA_VISIBLE_DEVICES,
    LOCAL_RANK, TORCHTOOLS_DEVICE,
};
pub use error::{Error, Result};
pub use inventory::{GpuInfo, GpuProcess, Inventory, MigInstance, NvmlStatus, VisibleGpu};
#[cfg(feature = "tch")]
pub use libtorch::{availability, report, select, select_device};
pub use report::{Backend, DeviceReport, LibtorchInfo, View};
pub use select::{select_with, Availability, CudaCandidate, Device, Selection};
