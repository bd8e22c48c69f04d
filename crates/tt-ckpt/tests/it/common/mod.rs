//! Helpers shared by the integration tests.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::path::Path;

/// How many temp files (`.tt-tmp-*`) are in `dir`.
#[allow(dead_code)] // not every test crate checks temp files
pub(crate) fn temps(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tt-tmp-"))
        .count()
}

/// Runs `script` with the setup venv's Python (TORCHTOOLS_PYTHON, which `cargo xtask
/// setup` exports through `.cargo/config.toml`) and returns its stdout. Fails, never
/// skips, without it.
#[allow(dead_code)] // not every test crate talks to Python
pub(crate) fn python(script: &str, args: &[&str]) -> String {
    tt_testkit::run_python(script, args)
}
