//! What the queue and sharing tests both stand on: a lock directory with a log file
//! beside it, the time as a number, and how long a step may take on a busy machine.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use tt_lock::LockDir;

/// The longest any step may take on a busy machine before a test calls it stuck.
pub(crate) const PATIENCE: Duration = Duration::from_secs(120);

/// Nanoseconds since the Unix epoch: comparable across processes.
pub(crate) fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A lock directory of its own and an empty log that child processes append to (one
/// `write` per line, so their lines never interleave).
pub(crate) struct Stage {
    _tmp: tempfile::TempDir,
    pub(crate) dir: LockDir,
    pub(crate) log: PathBuf,
}

impl Stage {
    pub(crate) fn new() -> Stage {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let log = tmp.path().join("granted.log");
        std::fs::write(&log, "").unwrap();
        Stage {
            _tmp: tmp,
            dir,
            log,
        }
    }

    /// The log's lines so far.
    pub(crate) fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}
