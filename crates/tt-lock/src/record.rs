//! The records of who holds a GPU and who shares one: each in a file of its own,
//! created by the process it describes (mode 0644 whatever the umask, so every user
//! reads it and only its owner can change or remove it), write-locked by that process
//! for as long as the record is true ([`crate::file::lock_record`]: a lock only a
//! process allowed to write the file can take, so another user's `flock` on it neither
//! makes it live nor keeps it alive). A record without that lock belongs to a process
//! that let go or died and counts for nothing; a record whose claimed user is not its
//! file's owner is ignored and reported ([`crate::Ignored`]).
//!
//! They live beside the lock files in the sticky lock directory, named after the GPU's
//! lock file: `held-gpu-0.<...>.json` for an exclusive holder, `share-gpu-0.<...>.json`
//! for a sharer. No subdirectory: its creator could remove every record in it, as only
//! the lock directory's owner (root, on a well-set-up server) can here.

use std::ffi::OsString;
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::file::{open_to_read, read_holder, record_live, same_file};
use crate::{GpuKey, Holder, Ignored, Result};

/// `gpu-0.` for `gpu-0.lock`: what every record of that GPU's is named after.
fn stem(key: &GpuKey) -> String {
    let name = key.file_name();
    format!("{}.", name.strip_suffix(".lock").unwrap_or(&name))
}

/// The prefix of every exclusive holder record of `key`'s GPU.
pub(crate) fn held_prefix(key: &GpuKey) -> String {
    format!("held-{}", stem(key))
}

/// The prefix of every ledger record of `key`'s GPU.
pub(crate) fn share_prefix(key: &GpuKey) -> String {
    format!("share-{}", stem(key))
}

/// This process's record: unlocked and removed when dropped (the kernel unlocks it
/// when the process dies, and the record then counts for nothing).
#[derive(Debug)]
pub(crate) struct OwnRecord {
    file: File,
    path: PathBuf,
    /// Whether this process made it (and so unlocks it); not when inherited.
    made_here: bool,
    /// A holder's record kept between holdings (see [`OwnRecord::holding`]): unlocked
    /// when dropped, not removed.
    kept: bool,
}

impl OwnRecord {
    /// Writes and locks `holder`'s record in `dir` under a name the readers ignore,
    /// then renames it to `<prefix><since>-<ns>-<pid>-<n>.json`: a record is never seen
    /// unlocked or half written.
    pub(crate) fn create(dir: &Path, prefix: &str, holder: &Holder) -> Result<OwnRecord> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let temp = dir.join(format!(".record-{pid}-{n}.tmp"));
        let ns = crate::holder::own_pid_namespace().unwrap_or(0);
        let path = dir.join(format!(
            "{prefix}{}-{ns}-{pid}-{n}.json",
            holder.who.since_unix
        ));
        let mut text = serde_json::to_vec(&holder.fitted()).unwrap_or_default();
        text.push(b'\n');
        let file = crate::file::create_locked(&temp, &path, &text, "creating the holder record")?;
        Ok(OwnRecord {
            file,
            path,
            made_here: true,
            kept: false,
        })
    }

    /// An exclusive holder's record: the file this user keeps for this GPU,
    /// `held-gpu-<GPU>.user-<UID>.json`, locked and rewritten in place, so that an
    /// uncontended lock changes no directory (a file created, renamed and removed at
    /// every lock made it five times slower than Python's bare `flock` in the lock
    /// bench). Only one process holds a GPU at a time, so the file is free whenever its
    /// GPU was; where it is not this user's own (another user made a file of that name)
    /// or is locked, a record of its own is made instead ([`OwnRecord::create`]).
    /// Between its `flock` and its write, a reader may still see this user's previous
    /// holding of the GPU for a few microseconds (as a lock file's record could be seen
    /// before).
    pub(crate) fn holding(dir: &Path, key: &GpuKey, holder: &Holder) -> Result<OwnRecord> {
        let path = dir.join(format!(
            "{}user-{}.json",
            held_prefix(key),
            crate::owner::euid()
        ));
        match Self::keep(&path, holder) {
            Some(record) => record,
            None => Self::create(dir, &held_prefix(key), holder),
        }
    }

    /// [`OwnRecord::holding`]'s kept file, when it is this user's and free: `None`
    /// otherwise.
    fn keep(path: &Path, holder: &Holder) -> Option<Result<OwnRecord>> {
        let (file, len) = crate::file::own_locked(path)?;
        let record = OwnRecord {
            file,
            path: path.to_owned(),
            made_here: true,
            kept: true,
        };
        Some(
            crate::file::write_record_over(&record.file, &record.path, holder, len)
                .map(|()| record),
        )
    }

    /// A parent's record, inherited with its lock (`path`: the lock's, for errors).
    pub(crate) fn inherited(file: File, path: &Path) -> OwnRecord {
        OwnRecord {
            file,
            path: path.to_owned(),
            made_here: false,
            kept: false,
        }
    }

    /// The holder it says.
    pub(crate) fn read(&self) -> Option<Holder> {
        read_holder(&self.file)
    }

    /// Makes it count for nothing (it stays until dropped).
    pub(crate) fn unlock(&self) {
        if self.made_here {
            crate::file::unlock_record(&self.file);
        }
    }

    /// Rewrites the record in place (the holder changed: its usage id, the command's
    /// pid, its fence): a reader meanwhile never finds it empty.
    pub(crate) fn write(&self, holder: &Holder) -> Result<()> {
        crate::file::write_record(&self.file, &self.path, holder)
    }

    /// The record's descriptor, for a child that inherits it with the lock.
    pub(crate) fn as_raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

impl Drop for OwnRecord {
    fn drop(&mut self) {
        if !self.made_here {
            return;
        }
        // Unlocked first: from now on it counts for nothing, also where a child holds
        // a copy of the descriptor. Then removed (a kept one only closed), which wakes
        // the waiters: their watch sees the name go, or the file closed after writing.
        self.unlock();
        if !self.kept && same_file(&self.file, &self.path) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// The uid a kept holder record's name is for (`held-gpu-0.user-<UID>.json`).
fn kept_for(name: &str) -> Option<u32> {
    name.rsplit_once(".user-")?
        .1
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// A live record found by [`live`].
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub(crate) holder: Holder,
    /// The uid that owns the record's file: its writer.
    pub(crate) owner_uid: u32,
}

/// The live records among `names` in `dir` that start with `prefix`, believed ones
/// oldest first, and those ignored for naming another user than their file's owner.
/// Dead records of this user are removed on the way (another user's stay: the sticky
/// directory keeps them, and they count for nothing).
pub(crate) fn live(
    dir: &Path,
    names: impl IntoIterator<Item = OsString>,
    prefix: &str,
) -> (Vec<Found>, Vec<Ignored>) {
    let mut found = Vec::new();
    let mut ignored = Vec::new();
    for name in names {
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(prefix) && name.ends_with(".json")) {
            continue;
        }
        let path = dir.join(name);
        let Some((file, meta)) = open_to_read(&path) else {
            continue;
        };
        if let Some(named) = kept_for(name).filter(|&uid| uid != meta.uid()) {
            // Another user's file under the name a user keeps its record in: never
            // that user's record, live or not (the user writes one of its own).
            let claims = read_holder(&file).map_or_else(String::new, |h| h.who.user);
            ignored.push(Ignored::because(
                &path,
                meta.uid(),
                &claims,
                format!(
                    "planted under the name uid {named} keeps its record in ({}): not used \
                     nor believed; its owner or root may remove it",
                    crate::owner::name_of_uid(named)
                ),
            ));
            continue;
        }
        if !record_live(&file) {
            // A dead record of this user's goes, but not a kept one: its holder may be
            // taking it again right now.
            if meta.uid() == crate::owner::euid() && kept_for(name).is_none() {
                let _ = fs::remove_file(&path);
            }
            continue;
        }
        let Some(holder) = read_holder(&file) else {
            // A live record nobody can read: counted for nothing, and said.
            ignored.push(Ignored::because(
                &path,
                meta.uid(),
                "",
                "a live record that cannot be read (not one JSON line of at most 64 KiB): \
                 not counted"
                    .into(),
            ));
            continue;
        };
        let believed = crate::owner::check(&path, meta.uid(), &holder.who.user)
            .and_then(|()| believe(holder, &path, &meta, Floor::Birth));
        match believed {
            Ok(holder) => found.push(Found {
                holder,
                owner_uid: meta.uid(),
            }),
            Err(why) => ignored.push(why),
        }
    }
    found.sort_by_key(|f| (f.holder.who.since_unix, f.holder.who.pid));
    (found, ignored)
}

/// Where a record's age starts at the earliest, as the kernel says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Floor {
    /// A holder's or sharer's record: its file's birth and its process's start.
    Birth,
    /// A queue ticket: when its file was placed in the directory (its status change
    /// time: the rename or link that placed it set it, and nobody can set it back).
    Placed,
}

/// A believed record's values that steer others, bounded by what the machine knows. A
/// record is written by its owner, who could otherwise claim to be the oldest sharer
/// (whose keeper alone fences), to have waited longest (and preempt), or have `top` put
/// another user's process under its name:
/// - its `pid`, where it means something here (same host, same PID namespace), must be
///   a process of the file's owner or gone (a lock inherited by a child outlives its
///   first process); naming another user's process, the record is ignored and
///   reported;
/// - its `since_unix` is raised to the kernel's floor: the later of `floor`'s time of
///   the file and its process's start; where the process cannot be checked (gone, or
///   in another namespace or host), the file's last status change, which only its
///   owner's writes move, and only later; and lowered to now;
/// - its `command_pid` is dropped unless that process is its owner's.
pub(crate) fn believe(
    mut holder: Holder,
    path: &Path,
    meta: &fs::Metadata,
    floor: Floor,
) -> std::result::Result<Holder, Ignored> {
    bound_who(&mut holder.who, path, meta, floor)?;
    if let Some(pid) = holder.command_pid {
        let owners = here(&holder.who)
            .then(|| tt_device::procfs::uid(pid))
            .flatten();
        if owners.is_some_and(|uid| uid != meta.uid()) {
            holder.command_pid = None;
        }
    }
    Ok(holder)
}

/// Whether `who`'s pid means something in this process's view (same host, same PID
/// namespace).
fn here(who: &crate::Requester) -> bool {
    who.host == crate::holder::host_name()
        && who
            .pid_ns
            .is_none_or(|ns| Some(ns) == crate::holder::own_pid_namespace())
}

/// [`believe`]'s rule for who asked: the pid checked against the file's owner, the
/// start bounded by the kernel's times (see there).
pub(crate) fn bound_who(
    who: &mut crate::Requester,
    path: &Path,
    meta: &fs::Metadata,
    floor: Floor,
) -> std::result::Result<(), Ignored> {
    use std::os::unix::fs::MetadataExt;
    // The clock read in whole seconds: a record written now may say the next second.
    const SLACK: u64 = 2;
    let now = tt_device::now_unix_secs();
    let process_uid = here(who).then(|| tt_device::procfs::uid(who.pid)).flatten();
    if let Some(uid) = process_uid.filter(|&uid| uid != meta.uid()) {
        return Err(Ignored::because(
            path,
            meta.uid(),
            &who.user,
            format!(
                "it names pid {} as its process, which is {}'s (uid {uid}), not its \
                 owner's: not believed",
                who.pid,
                crate::owner::name_of_uid(uid)
            ),
        ));
    }
    // (A process's start, from btime's whole seconds, is read up to a second early:
    // never later than a record it wrote says.)
    let started = process_uid
        .and_then(|_| tt_device::procfs::started_unix(who.pid))
        .map(|t| t as u64);
    let changed = u64::try_from(meta.ctime()).unwrap_or(0);
    let born = || {
        meta.created()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
    };
    let floor = match (floor, started) {
        (Floor::Placed, started) => changed.max(started.unwrap_or(0)),
        (Floor::Birth, Some(started)) => born().unwrap_or(changed).max(started),
        (Floor::Birth, None) => changed,
    };
    who.since_unix = who.since_unix.max(floor).min(now + SLACK);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_named_after_the_gpu_and_never_taken_for_lock_files() {
        let key = GpuKey::of_uuid("GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
        assert_eq!(
            share_prefix(&key),
            "share-gpu-GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9."
        );
        assert_eq!(
            GpuKey::from_file_name(&format!("{}1-h-2-0.json", share_prefix(&key))),
            None
        );
        assert_eq!(share_prefix(&GpuKey::Index(3)), "share-gpu-3.");
        assert_eq!(held_prefix(&GpuKey::Index(3)), "held-gpu-3.");
        // GPU 1's records are not GPU 10's.
        assert!(!"held-gpu-10.5-0-1-0.json".starts_with(&held_prefix(&GpuKey::Index(1))));
    }
}
