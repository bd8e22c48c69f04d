//! tt-optim's tests: one test binary (linked once), a module per subject; `tests/gpu.rs` is
//! apart (`cargo xtask test-gpu`) and shares `tests/parity/` with it.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

#[cfg(feature = "tch")]
#[path = "../parity/mod.rs"]
mod parity;

#[cfg(feature = "tch")]
mod resume;
#[cfg(feature = "tch")]
mod torch_parity;
