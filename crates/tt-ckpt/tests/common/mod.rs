//! Helpers shared by the integration tests.

use std::path::Path;

/// How many temp files (`.tt-tmp-*`) are in `dir`.
pub(crate) fn temps(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tt-tmp-"))
        .count()
}
