//! tt-device's tests: one test binary (linked once), a module per subject; `tests/gpu.rs` is
//! apart (`cargo xtask test-gpu`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod env;
mod inventory;
#[cfg(feature = "tch")]
mod libtorch;
mod select;
mod slurm;
