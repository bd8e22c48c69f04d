//! tt-probe's tests: one test binary (linked once), a module per subject; `tests/gpu.rs` is
//! apart (`cargo xtask test-gpu`). `run` points the whole binary at a lock directory of its
//! own (TORCHTOOLS_LOCK_DIR), which `probe`'s tests never reserve in.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod probe;
#[cfg(feature = "tch")]
mod run;
