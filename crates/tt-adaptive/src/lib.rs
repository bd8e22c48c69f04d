//! OOM-adaptive execution, like [toma](https://github.com/BlackHC/toma): run work at a
//! batch size or step, and when it runs out of memory, retry smaller — without toma's
//! overhead, and with what its users ask for: a search back up toward the largest size
//! that fits, a minimum, statistics, hooks for a GPU fence and for agreement across
//! distributed ranks.
//!
//! | toma | tt-adaptive |
//! |---|---|
//! | `@toma.batch(initial_batchsize=512)`, `toma.execute.batch`, `toma.explicit.batch` | [`Adaptive::batch`]`(512, \|n\| ...)` |
//! | `@toma.range(initial_step=32)` | [`Adaptive::range`]`(start, end, 32, \|a, b\| ...)` |
//! | `@toma.chunked(initial_step=512)` | `Adaptive::chunked(&tensor, dim, 512, \|chunk, a, b\| ...)` (feature `tch`) |
//! | `StacktraceMemoryBatchsizeCache` (default) | [`Cache::CallSite`] (default): `#[track_caller]` site + free memory in 256 MiB buckets; a helper shared by several models gives each its key: [`Adaptive::batch_keyed`], [`Adaptive::range_keyed`] |
//! | `GlobalBatchsizeCache`, `NoBatchsizeCache` | [`Cache::Global`], [`Cache::None`] |
//! | halves, never grows back | [`Policy::Halve`], [`Policy::Factor`], [`Policy::Search`] (default), [`Adaptive::grow`] with [`Adaptive::max`] |
//! | `gc.collect()` + `empty_cache()` around every call | `empty_cache` only after a CUDA OOM, never on the success path |
//! | free memory of device 0 | the device you name ([`Adaptive::memory`]) |
//! | `set_cpu_memory_limit(gb)` | [`set_cpu_memory_limit`] (soft `RLIMIT_AS`, refused when CUDA is loaded), [`available_cpu_memory`] |
//!
//! Errors: a closure returns `Result<_, E>` where `E` is [`OomClassify`]
//! (`tch::TchError`, `String`, or yours). Out-of-memory errors (CUDA, cuDNN, cuBLAS,
//! CPU, MPS) are retried smaller; any other error is returned at once, untouched, as
//! [`AdaptiveError::Failed`]; when even [`Adaptive::min`] runs out of memory,
//! [`AdaptiveError::NoFit`]. tch's plain (non-`f_`) methods panic instead of returning
//! errors: use the `f_` forms inside adaptive closures, or opt in to
//! [`Adaptive::catch_oom_panics`].
//!
//! # Example
//!
//! ```
//! use tt_adaptive::{Adaptive, Policy};
//!
//! // A stand-in for a model step that needs n * 10 MB of a 10 GB budget.
//! let step = |n: usize| -> Result<usize, String> {
//!     if n * 10 > 10_000 { Err("CUDA out of memory. Tried to allocate".into()) } else { Ok(n) }
//! };
//! let adaptive = Adaptive::new().policy(Policy::Search);
//! let mut sizes = Vec::new();
//! for _ in 0..6 {
//!     // One call site: one cache entry. (A `String` error is not a std error: convert
//!     // it for `?`; tch's and your own error types work as they are.)
//!     sizes.push(adaptive.batch(4096, step).map_err(|e| e.to_string())?);
//! }
//! assert_eq!(sizes[0], 512);                    // 4096, 2048, 1024 ran out of memory
//! assert!(*sizes.last().unwrap() >= 950);       // then searched up to >= 95% of 1000
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adaptive;
mod classify;
mod memory;
#[cfg(feature = "tch")]
mod tch_support;

pub use adaptive::{Adaptive, AdaptiveError, AgreeHook, Cache, OomHook, Policy, SiteStats};
pub use classify::{classify_message, OomClassify, OomKind};
pub use memory::{
    address_space_in_use, available_cpu_memory, cuda_loaded, set_cpu_memory_limit, CpuMemory,
    LimitError, MemoryProbe,
};
#[cfg(feature = "tch")]
pub use tch_support::CudaMemory;
