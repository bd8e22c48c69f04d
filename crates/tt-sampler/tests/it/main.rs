//! tt-sampler's tests: one test binary (linked once), a module per subject.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod resume;
mod torch_parity;
