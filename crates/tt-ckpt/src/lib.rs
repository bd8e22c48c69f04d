#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod atomic;
mod checksum;
mod dir;
mod error;
mod format;
mod reader;
#[cfg(feature = "tch")]
mod tch_support;
mod tensor;
mod writer;

pub use atomic::{atomic_write, clean_stale_temps, AtomicFile};
pub use dir::{CheckpointDir, CheckpointEntry, Loaded};
pub use error::{Error, Result};
pub use format::{Checkpoint, LoadedCheckpoint, Meta, TensorFile, METADATA_KEY};
pub use safetensors::tensor::TensorView;
pub use safetensors::Dtype;
#[cfg(feature = "tch")]
pub use tch_support::{dtype_of, kind_of, LoadOptions, LoadReport};
pub use tensor::TensorData;
