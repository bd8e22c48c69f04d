//! A directory of numbered checkpoints with a `latest` pointer.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

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
///
/// [`save_async`](Self::save_async) writes on a background thread; the next save,
/// [`wait`](Self::wait), or dropping the directory joins it, and its error is
/// returned by the next save or `wait`, never lost.
#[derive(Debug)]
pub struct CheckpointDir {
    rules: Rules,
    pending: Mutex<Option<PendingSave>>,
    /// Host buffers of the last checkpoint written in the background.
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// A background save: its path (None on a non-writer) or its error.
type PendingSave = JoinHandle<Result<Option<PathBuf>>>;

/// What a save needs, shared with the background thread.
#[derive(Debug, Clone)]
struct Rules {
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
            rules: Rules {
                dir,
                keep_last: None,
                writer,
            },
            pending: Mutex::new(None),
            pool: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Keeps only the newest `n` checkpoints (at least 1) after each save.
    pub fn keep_last(mut self, n: usize) -> Self {
        self.rules.keep_last = Some(n.max(1));
        self
    }

    /// Makes this process the writer or not (overrides the `RANK` rule).
    pub fn writer(mut self, writer: bool) -> Self {
        self.rules.writer = writer;
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.rules.dir
    }

    /// Saves `checkpoint` as `ckpt-<step>.safetensors` and points `latest` at it.
    /// Returns the path, or `None` on a process that is not the writer. A pending
    /// [`save_async`](Self::save_async) is finished first; if it failed, its error
    /// is returned ([`Error::PreviousSaveFailed`]) and nothing else is done.
    pub fn save(&self, checkpoint: &Checkpoint<'_>) -> Result<Option<PathBuf>> {
        self.join_pending()?;
        self.rules.save(checkpoint)
    }

    /// A new checkpoint of `step` that reuses the host buffers of the last one
    /// written by [`save_async`](Self::save_async): its `add_tch` copies then land in
    /// memory already touched, which on large models is most of the training stall.
    /// The directory keeps one checkpoint's worth of host memory for this.
    pub fn checkpoint(&self, step: u64) -> Checkpoint<'static> {
        let spare = self
            .pool
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default();
        Checkpoint::new(step).with_spare(spare)
    }

    /// Starts writing `checkpoint` (whose tensors are already in host memory: a
    /// `Checkpoint<'static>` owns its bytes) on a background thread and returns.
    /// The previous pending save is finished first, as in [`save`](Self::save).
    pub fn save_async(&self, checkpoint: Checkpoint<'static>) -> Result<()> {
        self.join_pending()?;
        if !self.rules.writer {
            return Ok(());
        }
        let rules = self.rules.clone();
        let pool = Arc::clone(&self.pool);
        let handle = std::thread::Builder::new()
            .name("tt-ckpt-save".into())
            .spawn(move || {
                let saved = rules.save(&checkpoint);
                if let Ok(mut p) = pool.lock() {
                    *p = checkpoint.into_buffers();
                }
                saved
            })
            .map_err(io("start a save thread for", &self.rules.dir))?;
        *self.lock_pending()? = Some(handle);
        Ok(())
    }

    /// Waits for the pending [`save_async`](Self::save_async), if any: its path, or
    /// its error.
    pub fn wait(&self) -> Result<Option<PathBuf>> {
        let handle = self.lock_pending()?.take();
        match handle {
            None => Ok(None),
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(Error::SaveThread("the save thread panicked".into()))),
        }
    }

    fn join_pending(&self) -> Result<()> {
        self.wait()
            .map(drop)
            .map_err(|e| Error::PreviousSaveFailed(Box::new(e)))
    }

    fn lock_pending(&self) -> Result<std::sync::MutexGuard<'_, Option<PendingSave>>> {
        self.pending
            .lock()
            .map_err(|_| Error::SaveThread("a save thread panicked while registering".into()))
    }

    /// The checkpoint files, oldest first.
    pub fn list(&self) -> Result<Vec<CheckpointEntry>> {
        self.rules.list()
    }
    /// The newest valid checkpoint: the one `latest` names if it verifies, else the
    /// newest that does, with what was skipped. No valid checkpoint is
    /// [`Error::NoCheckpoint`] (listing what was tried); an empty directory too.
    pub fn load_latest(&self) -> Result<Loaded> {
        let mut skipped = Vec::new();
        let pointed = std::fs::read_to_string(self.rules.dir.join(LATEST))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| step_of(s).is_some());
        let mut candidates: Vec<PathBuf> = self
            .rules
            .list()?
            .into_iter()
            .rev()
            .map(|e| e.path)
            .collect();
        if let Some(name) = pointed {
            let p = self.rules.dir.join(name);
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
            dir: self.rules.dir.clone(),
            skipped,
        })
    }
}

impl Drop for CheckpointDir {
    /// Finishes a pending save; its error, which nobody can receive any more, is logged.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!(error = %e, "a background checkpoint save failed");
        }
    }
}

impl Rules {
    fn save(&self, checkpoint: &Checkpoint<'_>) -> Result<Option<PathBuf>> {
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

    fn list(&self) -> Result<Vec<CheckpointEntry>> {
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
}
