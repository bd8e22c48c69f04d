//! Sub-tracking in a build without the `sqlite` feature: SQLite files are refused
//! with the way to read them.
// Left out of mutation testing: the refusal of SQLite files in a build without the
// `sqlite` feature; the measured build has it (the CI matrix's no-features step tests
// the refusal).
#![cfg_attr(mutants, mutants::skip)]

use std::path::Path;

use super::super::{error, Event, Timepoints};
use crate::Result;

fn no_sqlite(path: &Path) -> crate::Error {
    error(
        path,
        "SQLite files need tt-tracker's `sqlite` feature (the `torchtools` command has it)",
    )
}

pub(super) fn sqlite_timepoints(path: &Path) -> Result<Timepoints> {
    Err(no_sqlite(path))
}

pub(super) fn sqlite_events(path: &Path) -> Result<Vec<Event>> {
    Err(no_sqlite(path))
}

pub(super) fn write_sqlite(path: &Path, _: &[Event]) -> Result<()> {
    Err(no_sqlite(path))
}
