#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adaptive;
mod classify;
mod memory;
#[cfg(feature = "tch")]
mod tch_support;

pub use adaptive::{
    default_cache, set_default_cache, Adaptive, AdaptiveError, AgreeHook, Cache, OomHook, Policy,
    SiteStats,
};
pub use classify::{classify_message, OomClassify, OomKind};
pub use memory::{
    address_space_in_use, address_space_limit, available_cpu_memory, cuda_loaded,
    set_cpu_memory_limit, CpuMemory, LimitError, MemoryProbe,
};
#[cfg(feature = "tch")]
pub use memory::{CudaMemory, DeviceMemory};
