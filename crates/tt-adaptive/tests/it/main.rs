//! tt-adaptive's tests: one test binary (linked once), a module per subject; `tests/gpu.rs` is
//! apart (`cargo xtask test-gpu`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod adaptive;
mod defaults;
#[cfg(feature = "tch")]
mod libtorch;
