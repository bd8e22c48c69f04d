//! Several jobs on one GPU by memory budget.
//!
//! A sharer holds a *shared* `flock` (`LOCK_SH`) on the GPU's lock file, so the kernel
//! keeps sharers and an exclusive holder apart by itself: an exclusive request cannot
//! take the lock while any sharer holds it, and a sharer cannot while an exclusive
//! holder does. Each sharer's budget is in the ledger: one record per sharer,
//! `share-<GPU>.<id>.json` (mode 0644: every user reads it, only its owner removes it),
//! `flock`ed by its sharer for as long as it shares. A record whose lock is free
//! belongs to a sharer that died (`kill -9`, the OOM killer) and counts for nothing, so
//! the ledger heals as a lock does. A shared request is admitted under the directory's
//! own lock (the one that numbers queue tickets): no exclusive holder, its bytes fit
//! beside the live sharers' within the GPU's capacity, and no earlier request in the
//! queue waits for the GPU (first come, first served, shared and exclusive requests
//! alike).

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tt_device::Bytes;

use crate::file::{open_to_read, probe_held, read_holder, same_file};
use crate::queue::DirLock;
use crate::{Error, GpuKey, Holder, LockDir, Result};

/// The prefix of every ledger record of `key`'s GPU.
fn record_prefix(key: &GpuKey) -> String {
    let name = key.file_name();
    let stem = name.strip_suffix(".lock").unwrap_or(&name);
    format!("share-{stem}.")
}

/// This process's ledger record: removed and unlocked when dropped (the kernel unlocks
/// it when the process dies).
#[derive(Debug)]
pub(crate) struct ShareRecord {
    file: File,
    path: PathBuf,
}

impl ShareRecord {
    /// Rewrites the record (the holder changed: its usage id, the command's pid), in
    /// place as a lock file's record: an admission reading it meanwhile never finds it
    /// empty, and so never leaves its budget out.
    pub(crate) fn write(&self, holder: &Holder) -> Result<()> {
        crate::file::write_record(&self.file, &self.path, holder)
    }

    /// The record's descriptor, for a child that inherits the share.
    pub(crate) fn as_raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

impl Drop for ShareRecord {
    fn drop(&mut self) {
        if same_file(&self.file, &self.path) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Why a shared request cannot be admitted now.
pub(crate) enum NotAdmitted {
    /// Someone holds the GPU exclusively (its record, when readable).
    Exclusive(Option<Holder>),
    /// The live sharers' budgets leave less than asked.
    Full {
        /// The live sharers, oldest first.
        sharers: Vec<Holder>,
    },
}

impl LockDir {
    /// The jobs sharing `key`'s GPU now, oldest first, each with its budget in
    /// [`Holder::share`]. A sharer that died is not listed (its record is removed when
    /// this user owns it).
    pub fn sharers(&self, key: &GpuKey) -> Result<Vec<Holder>> {
        let prefix = record_prefix(key);
        let mut sharers = Vec::new();
        for name in self.names()? {
            let Some(name) = name.to_str() else { continue };
            if !(name.starts_with(&prefix) && name.ends_with(".json")) {
                continue;
            }
            let path = self.path().join(name);
            let Some((file, meta)) = open_to_read(&path) else {
                continue;
            };
            if !probe_held(&file) {
                // Its sharer died: the record counts for nothing; its owner tidies it.
                if meta.uid() == nix::unistd::geteuid().as_raw() {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            if let Some(holder) = read_holder(&file).filter(|h| h.share.is_some()) {
                sharers.push(holder);
            }
        }
        sharers.sort_by_key(|h| (h.since_unix, h.pid));
        Ok(sharers)
    }

    /// One attempt to admit a shared request of `bytes` on `key`'s GPU of `capacity`,
    /// with `lock_file` (the GPU's lock file, opened by the caller): on success the
    /// shared `flock` is held on it and the ledger record written.
    pub(crate) fn try_share(
        &self,
        key: &GpuKey,
        lock_file: &File,
        lock_path: &Path,
        capacity: Bytes,
        holder: &Holder,
    ) -> Result<std::result::Result<ShareRecord, NotAdmitted>> {
        let bytes = holder.share.unwrap_or_default();
        let _admission = DirLock::take(self)?;
        // SAFETY: the fd is open for the duration of the call.
        if unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EWOULDBLOCK | libc::EINTR) => {
                    Ok(Err(NotAdmitted::Exclusive(read_holder(lock_file))))
                }
                _ => Err(Error::Io {
                    op: "share-locking",
                    path: lock_path.to_owned(),
                    cause: e,
                }),
            };
        }
        let unlock = || {
            // SAFETY: the fd is open for the duration of the call.
            unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_UN) };
        };
        let sharers = match self.sharers(key) {
            Ok(s) => s,
            Err(e) => {
                unlock();
                return Err(e);
            }
        };
        let used: u64 = sharers.iter().filter_map(|h| h.share).map(|b| b.0).sum();
        if used.saturating_add(bytes.0) > capacity.0 {
            unlock();
            return Ok(Err(NotAdmitted::Full { sharers }));
        }
        match self.create_record(key, holder) {
            Ok(record) => Ok(Ok(record)),
            Err(e) => {
                unlock();
                Err(e)
            }
        }
    }

    /// Writes and locks a ledger record under a name the ledger ignores, then renames
    /// it into place: a record is never seen unlocked or half written.
    fn create_record(&self, key: &GpuKey, holder: &Holder) -> Result<ShareRecord> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let temp = self.path().join(format!(".share-{pid}-{n}.tmp"));
        let (since, ns) = (
            holder.since_unix,
            crate::holder::own_pid_namespace().unwrap_or(0),
        );
        let path = self
            .path()
            .join(format!("{}{since}-{ns}-{pid}-{n}.json", record_prefix(key)));
        let mut text = serde_json::to_vec(holder).unwrap_or_default();
        text.push(b'\n');
        let file = crate::file::create_locked(&temp, &path, &text, "creating the share record")?;
        Ok(ShareRecord { file, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_named_after_the_gpu_and_never_taken_for_lock_files() {
        let key = GpuKey::of_uuid("GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
        let prefix = record_prefix(&key);
        assert_eq!(
            prefix,
            "share-gpu-GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9."
        );
        assert_eq!(
            GpuKey::from_file_name(&format!("{prefix}1-h-2-0.json")),
            None
        );
        assert_eq!(record_prefix(&GpuKey::Index(3)), "share-gpu-3.");
    }
}
