//! Atomic, verified, Python-readable training checkpoints.
//!
//! - [`atomic_write`]: replace a file durably: unique temp file beside it, write,
//!   `fsync`, rename, `fsync` the directory. After a crash the file is the old one
//!   or the new one, never empty or mixed (cycling_utils' `.temp` + `os.replace`
//!   has no fsync and a fixed temp name).
//! - [`Checkpoint`] / [`LoadedCheckpoint`]: a [safetensors] file (Python reads it
//!   with `safetensors.torch.load_file`) whose header carries torchtools' metadata:
//!   step, epoch, serde values (a sampler state, say), library versions and an
//!   xxh3 checksum of every tensor, verified on load.
//! - [`CheckpointDir`]: `ckpt-00000123.safetensors` files, a `latest` pointer,
//!   `keep_last(n)` rotation, and `load_latest()` that falls back to the newest
//!   valid checkpoint and says what it skipped. Only rank 0 writes by default. A
//!   directory is one run: a save below steps already there is refused unless asked
//!   for (see [one directory, one run](CheckpointDir#one-directory-one-run)).
//!
//! This crate needs no libtorch: tensors are bytes with a dtype and a shape.
//!
//! # Example
//!
//! ```
//! use tt_ckpt::{Checkpoint, CheckpointDir, TensorData};
//!
//! let root = tempfile::tempdir()?;
//! let dir = CheckpointDir::open(root.path().join("run"))?.keep_last(2);
//! for step in [100, 200, 300] {
//!     let mut ckpt = Checkpoint::new(step).with_epoch(1);
//!     ckpt.set_value("lr", &0.01)?;
//!     ckpt.add_tensor("w", TensorData::from_f32(vec![2], &[step as f32, 1.0])?)?;
//!     dir.save(&ckpt)?;
//! }
//! assert_eq!(dir.list()?.len(), 2); // rotation kept the newest two
//! let loaded = dir.load_latest()?.expect("three were saved"); // None: nothing yet
//! assert!(loaded.skipped.is_empty());
//! assert_eq!(loaded.checkpoint.step(), 300);
//! assert_eq!(loaded.checkpoint.value::<f64>("lr")?, 0.01);
//! assert_eq!(loaded.checkpoint.tensor("w")?.data(), &[0, 0, 150, 67, 0, 0, 128, 63]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [safetensors]: https://huggingface.co/docs/safetensors
#![cfg_attr(docsrs, feature(doc_cfg))]

mod atomic;
mod dir;
mod error;
mod format;
#[cfg(feature = "tch")]
mod tch_support;
mod writer;

pub use atomic::{atomic_write, clean_stale_temps};
pub use dir::{CheckpointDir, CheckpointEntry, Loaded};
pub use error::{Error, Result};
pub use format::{Checkpoint, LoadedCheckpoint, Meta, TensorData, TensorFile, METADATA_KEY};
pub use safetensors::tensor::TensorView;
pub use safetensors::Dtype;
#[cfg(feature = "tch")]
pub use tch_support::{dtype_of, kind_of, LoadOptions, LoadReport};
