//! tt-ckpt's tests: one test binary (linked once), a module per subject; `tests/gpu.rs`
//! (`cargo xtask test-gpu`) and `tests/load_memory.rs` (which measures its process's
//! memory) are apart.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod common;

mod crash;
mod dir;
mod full_disk;
#[cfg(feature = "tch")]
mod libtorch;
mod python;
#[cfg(feature = "tch")]
mod torch_weights;
