//! A directory of numbered checkpoints with a `latest` pointer.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::atomic::{atomic_write, clean_stale_temps};
use crate::error::io;
use crate::{Checkpoint, Error, LoadedCheckpoint, Result};

const LATEST: &str = "latest";
/// Where [`CheckpointDir::supersede_newer`] moves another timeline's later steps.
const SUPERSEDED: &str = "superseded";
/// Where files that `load_latest` found damaged go when the run saves past them.
const DAMAGED: &str = "damaged";

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
/// (a one-line file naming it) the same way, then removes the lowest steps beyond
/// [`keep_last`](Self::keep_last); the file just saved is never removed. Loading
/// takes the newest valid step, verifies the file, and falls back to the next valid
/// one, saying what it skipped. Works on a shared filesystem: only the writer (rank 0
/// by default) writes; every rank can read.
///
/// # One directory, one run
///
/// The steps in a directory are one run's timeline, so "newest" is "highest step".
/// Saving a step below a valid checkpoint already there would mix two timelines (a
/// new run started where a finished one left steps 1000 to 3000, or a run rolled
/// back to an earlier step): the rotation would delete the new file, and a later
/// resume would quietly pick the other run. So such a save is refused with
/// [`Error::NewerCheckpoints`], before anything is written, naming the steps and the
/// ways out: resume from them ([`load_latest`](Self::load_latest)), use another
/// directory, or open this one with [`supersede_newer`](Self::supersede_newer),
/// which moves them into `superseded/` (nothing is deleted). Saving the same step
/// again replaces that file.
///
/// Files that this directory's [`load_latest`](Self::load_latest) skipped as damaged
/// are not a conflict: the run resumed from an older step on purpose, and its next
/// save moves them into `damaged/` (kept for inspection, out of the timeline).
///
/// [`save_async`](Self::save_async) writes on a background thread; the next save,
/// [`wait`](Self::wait), or dropping the directory joins it, and its error is
/// returned by the next save or `wait`, never lost.
#[derive(Debug)]
pub struct CheckpointDir {
    rules: Rules,
    /// Files `load_latest` skipped as damaged: moved aside by the next save that
    /// passes them.
    damaged: Mutex<Vec<PathBuf>>,
    pending: Mutex<Option<PendingSave>>,
    /// Host buffers of the last checkpoint written in the background.
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// A background save: its path (None on a non-writer) or its error.
type PendingSave = JoinHandle<Result<Option<PathBuf>>>;

/// A background save's outcome (`None` when there was none); a panic of its thread is
/// an error.
fn join_save(handle: Option<PendingSave>) -> Result<Option<PathBuf>> {
    match handle {
        None => Ok(None),
        Some(h) => h.join().unwrap_or_else(|_| {
            Err(Error::SaveThread {
                reason: "the save thread panicked".into(),
            })
        }),
    }
}

/// What a save needs, shared with the background thread.
#[derive(Debug, Clone)]
struct Rules {
    dir: PathBuf,
    keep_last: Option<usize>,
    writer: bool,
    supersede_newer: bool,
}

/// Rotated checkpoints are renamed to this prefix, then removed off the save's path.
const TRASH_PREFIX: &str = ".tt-trash-";

/// Removes `files`; one already gone (another thread got there first) is fine.
fn remove_all(files: &[PathBuf]) {
    for f in files {
        if let Err(e) = std::fs::remove_file(f) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %f.display(), error = %e, "could not remove a rotated checkpoint");
            }
        }
    }
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
    /// Opens (creating it if needed) the directory. The writer is rank 0 of the
    /// launcher's variables: torchrun's `RANK`, else Slurm's `SLURM_PROCID` (the one
    /// process when neither is set), read as [`tt_dist::Place`] reads them, the rule
    /// every torchtools crate follows. A bad or partial value is
    /// [`Error::Environment`], before anything is created. [`writer`](Self::writer)
    /// overrides the rule.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let place = tt_dist::Place::from_env().map_err(|cause| Error::Environment {
            dir: dir.clone(),
            cause,
        })?;
        std::fs::create_dir_all(&dir).map_err(io("create the checkpoint directory", &dir))?;
        let writer = place.is_main();
        Ok(CheckpointDir {
            rules: Rules {
                dir,
                keep_last: None,
                writer,
                supersede_newer: false,
            },
            damaged: Mutex::new(Vec::new()),
            pending: Mutex::new(None),
            pool: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Keeps only the newest `n` checkpoints (at least 1) after each save.
    pub fn keep_last(mut self, n: usize) -> Self {
        self.rules.keep_last = Some(n.max(1));
        self
    }

    /// Lets a save go below steps already in the directory: those later steps (another
    /// run's, or this run's before a roll-back) are moved into
    /// `<dir>/superseded/before-step-<step>-<time>/` by the first such save, so that
    /// the directory holds one timeline again. Nothing is deleted. Without it such a
    /// save is [`Error::NewerCheckpoints`] (see [one directory, one
    /// run](Self#one-directory-one-run)).
    pub fn supersede_newer(mut self) -> Self {
        self.rules.supersede_newer = true;
        self
    }

    /// Makes this process the writer or not (overrides the rank rule of
    /// [`open`](Self::open)).
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
    ///
    /// A step below a valid checkpoint already in the directory is
    /// [`Error::NewerCheckpoints`] unless [`supersede_newer`](Self::supersede_newer)
    /// was asked for; nothing is written then.
    pub fn save(&self, checkpoint: &Checkpoint<'_>) -> Result<Option<PathBuf>> {
        self.join_pending()?;
        if !self.rules.writer {
            return Ok(None);
        }
        self.prepare(checkpoint.step())?;
        self.rules.write(checkpoint).map(Some)
    }

    /// Makes room for a save of `step` in the timeline: later steps are damaged
    /// files moved aside, superseded ones moved aside, or a refusal.
    fn prepare(&self, step: u64) -> Result<()> {
        let mut damaged = self.damaged.lock().map_err(|_| Error::SaveThread {
            reason: "a thread panicked while loading".into(),
        })?;
        self.rules.prepare(step, &damaged)?;
        damaged.clear();
        Ok(())
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
    /// The previous pending save is finished first, as in [`save`](Self::save), and
    /// a step below the directory's newer checkpoints is refused at once, as there.
    pub fn save_async(&self, checkpoint: Checkpoint<'static>) -> Result<()> {
        self.join_pending()?;
        if !self.rules.writer {
            return Ok(());
        }
        self.prepare(checkpoint.step())?;
        let rules = self.rules.clone();
        let pool = Arc::clone(&self.pool);
        let handle = std::thread::Builder::new()
            .name("tt-ckpt-save".into())
            .spawn(move || {
                let saved = rules.write(&checkpoint).map(Some);
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
        join_save(handle)
    }

    /// The pending [`save_async`](Self::save_async)'s path once it has finished (or its
    /// error), without waiting: `None` while it is still writing, or when none is
    /// pending. A training loop calls it each step to say "saved" as soon as a
    /// background checkpoint is durable.
    pub fn poll(&self) -> Result<Option<PathBuf>> {
        let mut pending = self.lock_pending()?;
        let finished = pending.as_ref().is_some_and(JoinHandle::is_finished);
        join_save(if finished { pending.take() } else { None })
    }

    fn join_pending(&self) -> Result<()> {
        self.wait()
            .map(drop)
            .map_err(|e| Error::PreviousSaveFailed(Box::new(e)))
    }

    fn lock_pending(&self) -> Result<std::sync::MutexGuard<'_, Option<PendingSave>>> {
        self.pending.lock().map_err(|_| Error::SaveThread {
            reason: "a save thread panicked while registering".into(),
        })
    }

    /// The checkpoint files, oldest first.
    pub fn list(&self) -> Result<Vec<CheckpointEntry>> {
        self.rules.list()
    }
    /// The newest valid checkpoint: the highest step that verifies, with the newer
    /// files it skipped and why. This is the file `latest` names, unless a crash came
    /// between the checkpoint's rename and the pointer's, when it is the newer,
    /// complete file. `None` when the directory has no checkpoint yet (a first run);
    /// files that are all damaged are [`Error::NoCheckpoint`], listing what was tried
    /// and why, never a silent start from scratch.
    ///
    /// The skipped files are remembered: this directory's next save past them moves
    /// them into `damaged/` (see [one directory, one run](Self#one-directory-one-run)).
    pub fn load_latest(&self) -> Result<Option<Loaded>> {
        let mut skipped = Vec::new();
        let entries = self.rules.list()?;
        if entries.is_empty() {
            return Ok(None);
        }
        let candidates = entries.into_iter().rev().map(|e| e.path);
        let mut found = None;
        for path in candidates {
            match LoadedCheckpoint::read(&path) {
                Ok(checkpoint) => {
                    found = Some(checkpoint);
                    break;
                }
                Err(Error::Corrupt { reason, .. }) => skipped.push((path, reason)),
                Err(e) => skipped.push((path, e.to_string())),
            }
        }
        if let Ok(mut damaged) = self.damaged.lock() {
            *damaged = skipped.iter().map(|(p, _)| p.clone()).collect();
        }
        match found {
            Some(checkpoint) => Ok(Some(Loaded {
                checkpoint,
                skipped,
            })),
            None => Err(Error::NoCheckpoint {
                dir: self.rules.dir.clone(),
                skipped,
            }),
        }
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
    /// Refuses a save of `step` below the directory's valid checkpoints, or moves
    /// them aside: `damaged` ones (skipped by `load_latest`) into `damaged/`, the
    /// others into `superseded/` when that was asked for.
    fn prepare(&self, step: u64, damaged: &[PathBuf]) -> Result<()> {
        let newer: Vec<CheckpointEntry> =
            self.list()?.into_iter().filter(|e| e.step > step).collect();
        if newer.is_empty() {
            return Ok(());
        }
        let (broken, valid): (Vec<_>, Vec<_>) =
            newer.into_iter().partition(|e| damaged.contains(&e.path));
        if !valid.is_empty() && !self.supersede_newer {
            return Err(Error::NewerCheckpoints {
                dir: self.dir.clone(),
                step,
                newer: valid.iter().map(|e| e.step).collect(),
            });
        }
        if !broken.is_empty() {
            self.move_aside(&broken, PathBuf::from(DAMAGED))?;
        }
        if !valid.is_empty() {
            let since_epoch = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let batch = format!(
                "before-step-{step:08}-{}.{:09}",
                since_epoch.as_secs(),
                since_epoch.subsec_nanos()
            );
            let to = self.move_aside(&valid, Path::new(SUPERSEDED).join(batch))?;
            tracing::warn!(
                step,
                newer = ?valid.iter().map(|e| e.step).collect::<Vec<_>>(),
                to = %to.display(),
                "moved checkpoints of later steps out of the run's directory"
            );
        }
        Ok(())
    }

    /// Renames `files` into `self.dir/sub` (created), durably; returns that folder.
    fn move_aside(&self, files: &[CheckpointEntry], sub: PathBuf) -> Result<PathBuf> {
        let to = self.dir.join(sub);
        std::fs::create_dir_all(&to).map_err(io("create", &to))?;
        for entry in files {
            let name = entry
                .path
                .file_name()
                .map(PathBuf::from)
                .unwrap_or_default();
            let mut target = to.join(&name);
            // A damaged file of the same name moved earlier stays too.
            let mut n = 1;
            while target.exists() {
                target = to.join(format!("{}.{n}", name.display()));
                n += 1;
            }
            std::fs::rename(&entry.path, &target).map_err(io("move aside", &entry.path))?;
        }
        for d in [&to, &self.dir] {
            File::open(d)
                .and_then(|f| f.sync_all())
                .map_err(io("fsync", d))?;
        }
        Ok(to)
    }

    /// Writes the checkpoint, points `latest` at it, and rotates.
    fn write(&self, checkpoint: &Checkpoint<'_>) -> Result<PathBuf> {
        clean_stale_temps(&self.dir)?;
        self.empty_trash();
        let name = file_name(checkpoint.step());
        let path = self.dir.join(&name);
        checkpoint.write_to(&path)?;
        atomic_write(self.dir.join(LATEST), |w| {
            w.write_all(format!("{name}\n").as_bytes())
        })?;
        if let Some(n) = self.keep_last {
            let mut trash = Vec::new();
            for old in self.list()?.iter().rev().skip(n) {
                // Never the file just saved (and `latest` names it), whatever else
                // the directory holds.
                if old.path == path {
                    continue;
                }
                // Out of the directory's view at once (a rename), freed later: the
                // unlink of a large file can take a fifth of a second (ext4 with
                // online discard), which the training loop need not wait for.
                let name = old
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned());
                let to = self
                    .dir
                    .join(format!("{TRASH_PREFIX}{}", name.unwrap_or_default()));
                match std::fs::rename(&old.path, &to) {
                    Ok(()) => trash.push(to),
                    Err(e) => {
                        tracing::warn!(path = %old.path.display(), error = %e, "could not remove an old checkpoint")
                    }
                }
            }
            if !trash.is_empty() {
                let spawned = std::thread::Builder::new()
                    .name("tt-ckpt-rotate".into())
                    .spawn(move || remove_all(&trash));
                if let Err(e) = spawned {
                    tracing::debug!(error = %e, "no thread to remove rotated checkpoints: the next save does");
                }
            }
        }
        Ok(path)
    }

    /// Removes rotated checkpoints that a process which exited did not get to free.
    fn empty_trash(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let leftovers: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(TRASH_PREFIX))
            .map(|e| e.path())
            .collect();
        remove_all(&leftovers);
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
