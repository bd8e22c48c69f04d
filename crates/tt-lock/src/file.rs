//! A lock directory's files as every part reads and writes them: opened safely, their
//! first-line JSON record (read, and rewritten in place), whether a lock is held,
//! whether a path still names the file opened, a locked file created whole.
//! (A leaf: `lock`, `queue`, `list` and `share` use it, and it uses none of them.)

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::Holder;

/// This user's usage log, open for appending (see `usage.rs`).
#[derive(Debug)]
pub(crate) struct OwnLog {
    pub(crate) file: File,
    /// The log does not end with a newline (a record cut short, by this process or
    /// an earlier one): the next record starts with one, so that it is read whole.
    pub(crate) cut: std::sync::atomic::AtomicBool,
}

/// Opens a file of the lock directory to read it: never through a symbolic link, never
/// blocking on a FIFO, and only a regular file; `None` otherwise (or when it vanished).
pub(crate) fn open_to_read(path: &Path) -> Option<(File, std::fs::Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    meta.file_type().is_file().then_some((file, meta))
}

/// Whether someone holds an exclusive lock on `file`: a non-blocking shared lock
/// fails then. (It may make a concurrent try-lock fail during the probe, which is why
/// `/proc/locks` is preferred.)
pub(crate) fn probe_held(file: &File) -> bool {
    // SAFETY: the fd is open for the duration of the calls.
    unsafe {
        if libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) == 0 {
            libc::flock(file.as_raw_fd(), libc::LOCK_UN);
            false
        } else {
            true
        }
    }
}

/// Whether a lock file just locked is still linked in a directory: not once deleted
/// (by a `/tmp` cleaner, say, after which the path names another file or nothing); an
/// error when it is not a regular file. One `statx`, made after the `flock`, serves
/// both, instead of an `fstat` when opening and a `stat` of the path besides: lock
/// files are only ever created in place and deleted, never renamed away.
pub(crate) fn is_linked(file: &File, path: &Path) -> crate::Result<bool> {
    let st = shape(file).map_err(|cause| crate::Error::Io {
        op: "reading",
        path: path.to_owned(),
        cause,
    })?;
    if !st.regular {
        return Err(not_a_regular_file(path.to_owned()));
    }
    Ok(st.links > 0)
}

/// What [`shape`] tells of an open file.
pub(crate) struct Shape {
    pub(crate) regular: bool,
    pub(crate) uid: u32,
    pub(crate) links: u32,
    pub(crate) len: u64,
}

/// An open file's type, link count and length, from a `statx` that asks for nothing
/// else. A full `fstat` asks for the change time too, which since Linux 6.13
/// (multigrain timestamps) makes the file's next write stamp a fine-grained time, a
/// journaled inode update on ext4, instead of the coarse one that most writes share:
/// 0.85 µs of each lock's record write on the 2-core VM.
pub(crate) fn shape(file: &File) -> std::io::Result<Shape> {
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let mask = libc::STATX_TYPE | libc::STATX_NLINK | libc::STATX_SIZE | libc::STATX_UID;
    // SAFETY: the fd is open, the path is a valid empty C string (AT_EMPTY_PATH: the fd
    // itself), and `st` is a writable statx buffer for the duration of the call.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            mask,
            st.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statx returned 0, so it filled the buffer (zeroed before besides).
    let st = unsafe { st.assume_init() };
    Ok(Shape {
        regular: u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFREG,
        uid: st.stx_uid,
        links: st.stx_nlink,
        len: st.stx_size,
    })
}

/// Whether `file` is still the file at `path` (same device and inode).
pub(crate) fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The record in a lock file, if it holds a readable one.
pub(crate) fn read_holder(file: &File) -> Option<Holder> {
    read_record(file)
}

/// The JSON record on the first line of a lock or ticket file (at most 64 KiB), if it
/// holds a readable one.
pub(crate) fn read_record<T: serde::de::DeserializeOwned>(file: &File) -> Option<T> {
    let mut buf = vec![0u8; 64 * 1024];
    let n = file.read_at(&mut buf, 0).ok()?;
    let line = buf[..n].split(|&b| b == b'\n').next()?;
    serde_json::from_slice(line).ok()
}

/// Creates `path` holding `text`, locked (`flock`, exclusive) by the returned file for
/// as long as it stays open: written and locked under the name `temp`, which the
/// directory's readers ignore, then renamed into place, so that nobody ever sees it
/// unlocked or half written. Mode 0644, set on the open file after creating it (a
/// umask of 077 would otherwise make it 0600, and other users could not read the
/// record: a queue they cannot see, a budget they do not count). Only its owner can
/// change or remove it in the sticky directory. `what` names it in errors ("the queue
/// ticket").
pub(crate) fn create_locked(
    temp: &Path,
    path: &Path,
    text: &[u8],
    what: &'static str,
) -> crate::Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io_err = |op: &'static str, path: &Path| {
        let path = path.to_owned();
        move |cause| crate::Error::Io { op, path, cause }
    };
    let create = || {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(temp)
    };
    let file = match create() {
        // A leftover of an earlier process with this pid: ours to remove.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(temp);
            create()
        }
        other => other,
    }
    .map_err(io_err(what, temp))?;
    let placed = file
        .set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(io_err("making readable by every user", temp))
        .and_then(|()| {
            // SAFETY: the fd is open for the duration of the call.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(io_err("locking", temp)(std::io::Error::last_os_error()));
            }
            Ok(())
        })
        .and_then(|()| file.write_all_at(text, 0).map_err(io_err("writing", temp)))
        .and_then(|()| std::fs::rename(temp, path).map_err(io_err("placing", path)));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(temp);
        return Err(e);
    }
    Ok(file)
}

/// Writes the record in place (then trims what a longer earlier record left), so a
/// reader never sees an empty record. The trim only when needed: a truncation is a
/// journaled metadata change, several times the cost of the `statx` that tells.
pub(crate) fn write_record(file: &File, path: &Path, holder: &Holder) -> crate::Result<()> {
    let before = shape(file).map_err(|cause| crate::Error::Io {
        op: "reading the length of",
        path: path.to_owned(),
        cause,
    })?;
    write_record_over(file, path, holder, before.len)
}

/// [`write_record`] over a record `before` bytes long.
pub(crate) fn write_record_over(
    file: &File,
    path: &Path,
    holder: &Holder,
    before: u64,
) -> crate::Result<()> {
    let io_err = |cause| crate::Error::Io {
        op: "writing the holder record to",
        path: path.to_owned(),
        cause,
    };
    let mut text = serde_json::to_vec(holder).unwrap_or_default();
    text.push(b'\n');
    file.write_all_at(&text, 0).map_err(io_err)?;
    if before > text.len() as u64 {
        file.set_len(text.len() as u64).map_err(io_err)?;
    }
    Ok(())
}

/// A lock path that is a directory, a FIFO, a device or a socket.
pub(crate) fn not_a_regular_file(path: std::path::PathBuf) -> crate::Error {
    crate::Error::Unsafe {
        path,
        reason: "the lock path is not a regular file; remove it (only torchtools should \
                 create files named gpu-*.lock there)"
            .into(),
    }
}
