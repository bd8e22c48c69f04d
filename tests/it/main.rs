//! The facade's tests: one test binary (linked once), a module per subject; `tests/gpu.rs` is
//! apart (`cargo xtask test-gpu`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

#[cfg(feature = "tch")]
mod demo;
#[cfg(feature = "dist")]
mod examples;
