//! tt-lock's tests: one test binary (linked once), a module per subject. `tests/trust.rs` is
//! apart: it changes the process's umask and copies its own binary for other users to
//! run (a fork by another test while the copy is written would make its exec fail).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod common;

mod locks;
mod queue;
mod share;
