//! A directory of numbered checkpoints with a `latest` pointer.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::atomic::{atomic_write, clean_stale_temps};
use crate::error::io;
use crate::{Checkpoint, Error, LoadedCheckpoint, Result};

const LATEST: &str = "latest";

/// One checkpoint file of a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointEntry {
    /// The step in its name.
    pub step: u64,
    /// Its path.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
}

/// What [`CheckpointDir::load_latest`] found: the checkpoint, and every newer file
/// it had to skip, with the reason.
#[derive(Debug)]
pub struct Loaded {
    /// The newest valid checkpoint.
    pub checkpoint: LoadedCheckpoint,
    /// Files tried first and refused (corrupt, truncated, unreadable), newest first.
    pub skipped: Vec<(PathBuf, String)>,
}

/// A directory of `ckpt-00000123.safetensors` files and a `latest` pointer.
///
/// Saving writes the numbered file atomically and durably, then replaces `latest`
/// (a one-line file naming it) the same way, then removes the oldest files beyond
/// [`keep_last`](Self::keep_last), never the newest. Loading follows `latest`,
/// verifies the file, and falls back to the newest valid one, saying what it
/// skipped. Works on a shared filesystem: only the writer (rank 0 by default)
/// writes; every rank can read.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep_last: Option<usize>,
    writer: bool,
}

fn file_name(step: u64) -> String {
    format!("ckpt-{step:08}.safetensors")
}

fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("ckpt-")?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

impl CheckpointDir {
    /// Opens (creating it if needed) the directory. The writer is rank 0 of
    /// torchrun's `RANK` (every process when `RANK` is unset).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(io("create the checkpoint directory", &dir))?;
        let writer = std::env::var("RANK")
            .map(|r| r.trim() == "0")
            .unwrap_or(true);
        Ok(CheckpointDir {
            dir,
            keep_last: None,
            writer,
        })
    }

    /// Keeps only the newest `n` checkpoints (at least 1) after each save.
    pub fn keep_last(mut self, n: usize) -> Self {
        self.keep_last = Some(n.max(1));
        self
    }

    /// Makes this process the writer or not (overrides the `RANK` rule).
    pub fn writer(mut self, writer: bool) -> Self {
        self.writer = writer;
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Saves `checkpoint` as `ckpt-<step>.safetensors` and points `latest` at it.
    /// Returns the path, or `None` on a process that is not the writer.
    pub fn save(&self, checkpoint: &Checkpoint<'_>) -> Result<Option<PathBuf>> {
        if !self.writer {
            return Ok(None);
        }
        clean_stale_temps(&self.dir)?;
        let name = file_name(checkpoint.step());
        let path = self.dir.join(&name);
        checkpoint.write_to(&path)?;
        atomic_write(self.dir.join(LATEST), |w| {
            w.write_all(format!("{name}\n").as_bytes())
        })?;
        if let Some(n) = self.keep_last {
            for old in self.list()?.iter().rev().skip(n) {
                // The newest is never among these: the list is sorted and n >= 1.
                if let Err(e) = std::fs::remove_file(&old.path) {
                    tracing::warn!(path = %old.path.display(), error = %e, "could not remove an old checkpoint");
                }
            }
        }
        Ok(Some(path))
    }

    /// The checkpoint files, oldest first.
    pub fn list(&self) -> Result<Vec<CheckpointEntry>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir)
            .map_err(io("list", &self.dir))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(step) = step_of(&name) {
                let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
                out.push(CheckpointEntry {
                    step,
                    path: entry.path(),
                    bytes,
                });
            }
        }
        out.sort_by_key(|e| e.step);
        Ok(out)
    }

    /// The newest valid checkpoint: the one `latest` names if it verifies, else the
    /// newest that does, with what was skipped. No valid checkpoint is
    /// [`Error::NoCheckpoint`] (listing what was tried); an empty directory too.
    pub fn load_latest(&self) -> Result<Loaded> {
        let mut skipped = Vec::new();
        let pointed = std::fs::read_to_string(self.dir.join(LATEST))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| step_of(s).is_some());
        let mut candidates: Vec<PathBuf> = self.list()?.into_iter().rev().map(|e| e.path).collect();
        if let Some(name) = pointed {
            let p = self.dir.join(name);
            candidates.retain(|c| *c != p);
            candidates.insert(0, p);
        }
        for path in candidates {
            match LoadedCheckpoint::read(&path) {
                Ok(checkpoint) => {
                    return Ok(Loaded {
                        checkpoint,
                        skipped,
                    })
                }
                Err(Error::Corrupt { reason, .. }) => skipped.push((path, reason)),
                Err(e) => skipped.push((path, e.to_string())),
            }
        }
        Err(Error::NoCheckpoint {
            dir: self.dir.clone(),
            skipped,
        })
    }
}
