//! tt-tracker's tests on reports and gpu_tracker's analysis: one test binary (linked once), a
//! module per subject. `tests/track.rs` is apart: its trackers measure their own test
//! process and its descendants, which other tests' Python children would add to;
//! `tests/gpu.rs` too (`cargo xtask test-gpu`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod report;
mod subtrack;
