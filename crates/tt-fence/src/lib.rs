//! A "fence": GPU memory taken from the driver and held, so that processes which do not
//! cooperate through [tt-lock] cannot allocate what a reserved training job will need,
//! then handed back — all of it ([`Fence::lower`], or drop), or part of it on demand
//! ([`Fence::shrink`], which tt-adaptive calls before it lowers a batch size).
//!
//! It uses the CUDA driver API (`libcuda.so`) through cudarc, loaded at run time: the
//! crate builds, and its CPU tests run, on machines without CUDA, where
//! [`Fence::raise`] returns [`Error::NoDriver`]. It needs no libtorch. The fence
//! allocates in the device's **primary context**, the one libtorch (and the CUDA
//! runtime) uses, so in a process that also runs libtorch there is one context, and
//! memory the fence frees is at once available to libtorch's caching allocator.
//!
//! [`Fence::raise`] measures free memory (`cuMemGetInfo`, after the context exists),
//! and allocates `free - keep_free - safety_margin` in chunks of at most
//! [`FenceOptions::max_chunk`]; when a chunk cannot be had (fragmentation, or another
//! process allocating at the same time), it halves the chunk size down to
//! [`MIN_CHUNK`], then stops: best effort, reported in [`Fence::report`]. Every chunk
//! is written once (`cuMemsetD8`) so that it is backed by real memory.
//!
//! What it does not do: protect against processes that allocate first, or against
//! the driver's own demand; a fence is cooperative politeness with teeth, not a quota.
//!
//! # Example
//!
//! ```
//! use tt_device::Bytes;
//! use tt_fence::{Error, Fence, FenceOptions};
//!
//! // Leave 6 GiB (plus the safety margin) free for the training job on cuda:0.
//! match Fence::raise(0, &FenceOptions::keep_free(Bytes::gib(6))) {
//!     Ok(mut fence) => {
//!         println!("{}", fence.report());
//!         fence.shrink(Bytes::gib(1))?; // give 1 GiB back to the job
//!         let freed = fence.lower()?;   // and the rest
//!         assert!(freed.0 > 0 || fence_was_empty());
//!     }
//!     // A machine without a GPU, like the one these docs are tested on.
//!     Err(Error::NoDriver { reason }) => println!("no fence: {reason}"),
//!     Err(e) => return Err(e.into()),
//! }
//! # fn fence_was_empty() -> bool { true }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [tt-lock]: https://docs.rs/tt-lock
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
mod fence;

pub use error::{Error, Result};
pub use fence::{Fence, FenceOptions, FenceReport, DEFAULT_SAFETY_MARGIN, MIN_CHUNK};
