//! The `torchtools` command's tests: the real binary, in real processes, with
//! controlled environments. One test binary (linked once) whose modules follow the
//! commands; `tests/gpu.rs` is apart (`cargo xtask test-gpu`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod common;

mod cli;
mod hooks;
mod jobs;
mod launch;
mod metrics;
mod probe;
mod readme;
mod reserve;
mod serve;
mod slurm;
mod subtrack;
mod top;
mod track;
mod trust;
mod usage;
