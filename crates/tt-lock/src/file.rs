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
    /// Its path.
    pub(crate) path: std::path::PathBuf,
    /// This process has looked whether its summary of totals is due.
    pub(crate) checked: std::sync::atomic::AtomicBool,
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
/// `/proc/locks` is preferred.) For the GPUs' shared lock files only: a record's
/// liveness is [`record_live`].
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

/// A whole-file open-file-description lock request of type `kind`.
fn whole_file(kind: libc::c_int) -> libc::flock {
    // SAFETY: an all-zero `flock` is a valid value (start 0, length 0: the whole file).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock
}

/// Takes a record's liveness lock: an open-file-description *write* lock
/// (`F_OFD_SETLK`) on the whole file, without waiting. Only a process that may write
/// the file can take one, that is its owner (or root): a `flock`, or a read lock, taken
/// by another user who can only read it neither makes the record live nor keeps it
/// alive. Like a `flock`, it belongs to the open file (inherited across `fork` and
/// `exec`) and the kernel drops it when the last descriptor closes, however the process
/// ends. `Ok(false)`: someone else holds a lock on it.
pub(crate) fn lock_record(file: &File) -> std::io::Result<bool> {
    use nix::fcntl::{fcntl, FcntlArg};
    match fcntl(file, FcntlArg::F_OFD_SETLK(&whole_file(libc::F_WRLCK))) {
        Ok(_) => Ok(true),
        Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Lets go of [`lock_record`]'s lock: from then on the record counts for nothing.
pub(crate) fn unlock_record(file: &File) {
    use nix::fcntl::{fcntl, FcntlArg};
    let _ = fcntl(file, FcntlArg::F_OFD_SETLK(&whole_file(libc::F_UNLCK)));
}

/// Whether a record is live: a write lock is held on it ([`lock_record`]), which only
/// a process allowed to write the file (its owner, or root) can hold. Asked with
/// `F_OFD_GETLK`, which takes no lock, so the probe never disturbs anyone; a `flock` or
/// a read lock that another user holds on the record is not seen (see
/// [`crate::list`]'s report of them).
pub(crate) fn record_live(file: &File) -> bool {
    use nix::fcntl::{fcntl, FcntlArg};
    let mut lock = whole_file(libc::F_RDLCK);
    match fcntl(file, FcntlArg::F_OFD_GETLK(&mut lock)) {
        Ok(_) => lock.l_type != libc::F_UNLCK as libc::c_short,
        Err(_) => false,
    }
}

/// This user's own file at `path` in the lock directory (created mode 0644 when
/// missing), write-locked ([`lock_record`]) without waiting, and its length: `None` when
/// the name is taken by something that is not this user's regular file (another user
/// may have put it there first), or when another process holds its lock. Opened
/// without `O_CREAT` first: `fs.protected_regular` refuses `O_CREAT` on another user's
/// file in a sticky directory.
pub(crate) fn own_locked(path: &Path) -> Option<(File, u64)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let open = |create: bool| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(create)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
    };
    let file = match open(false) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let file = open(true).ok()?;
            file.set_permissions(std::fs::Permissions::from_mode(0o644))
                .ok()?;
            file
        }
        Err(_) => return None,
    };
    let shape = shape(&file).ok()?;
    if !shape.regular || shape.uid != crate::owner::euid() {
        return None;
    }
    lock_record(&file).ok()?.then_some((file, shape.len))
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

/// Creates `path` holding `text`, locked ([`lock_record`]) by the returned file for
/// as long as it stays open: written and locked aside ([`create_locked_aside`]), then
/// renamed into place, so that nobody ever sees it unlocked or half written. Only its
/// owner can change or remove it in the sticky directory. `what` names it in errors
/// ("the queue ticket").
pub(crate) fn create_locked(
    temp: &Path,
    path: &Path,
    text: &[u8],
    what: &'static str,
) -> crate::Result<File> {
    let (file, temp) = create_locked_aside(temp, text, what)?;
    if let Err(cause) = std::fs::rename(&temp, path) {
        let _ = std::fs::remove_file(&temp);
        return Err(crate::Error::Io {
            op: "placing",
            path: path.to_owned(),
            cause,
        });
    }
    Ok(file)
}

/// Creates a file holding `text` under the name `temp` (which the directory's readers
/// ignore), or a name beside it when another user put a file there first, locked
/// ([`lock_record`]) by the returned file; also returns the name used. Mode 0644, set on
/// the open file after creating it (a umask of 077 would otherwise make it 0600, and
/// other users could not read the record: a queue they cannot see, a budget they do not
/// count).
pub(crate) fn create_locked_aside(
    temp: &Path,
    text: &[u8],
    what: &'static str,
) -> crate::Result<(File, std::path::PathBuf)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io_err = |op: &'static str, path: &Path| {
        let path = path.to_owned();
        move |cause| crate::Error::Io { op, path, cause }
    };
    let create = |name: &Path| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(name)
    };
    let mut name = temp.to_owned();
    let mut tries = 0u32;
    let file = loop {
        match create(&name) {
            // A leftover of an earlier process with this pid (ours to remove), or a
            // file another user put under the name (which stays: another name then).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => {
                if std::fs::remove_file(&name).is_err() || tries > 0 {
                    let nanos = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos());
                    let mut other = temp.as_os_str().to_owned();
                    other.push(format!(".{nanos:x}{tries}"));
                    name = other.into();
                }
                tries += 1;
            }
            other => break other.map_err(io_err(what, &name))?,
        }
    };
    let ready = file
        .set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(io_err("making readable by every user", &name))
        .and_then(|()| match lock_record(&file) {
            Ok(true) => Ok(()),
            // Someone opened our fresh file and locked it first: not ours to use.
            Ok(false) => Err(io_err("locking", &name)(std::io::Error::from(
                std::io::ErrorKind::WouldBlock,
            ))),
            Err(e) => Err(io_err("locking", &name)(e)),
        })
        .and_then(|()| file.write_all_at(text, 0).map_err(io_err("writing", &name)));
    if let Err(e) = ready {
        let _ = std::fs::remove_file(&name);
        return Err(e);
    }
    Ok((file, name))
}

/// Places the file named `temp` at `path` unless something is there already
/// (`renameat2` with `RENAME_NOREPLACE`): `Ok(false)` when `path` is taken.
pub(crate) fn place_new(temp: &Path, path: &Path) -> crate::Result<bool> {
    use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};
    match renameat2(
        AT_FDCWD,
        temp,
        AT_FDCWD,
        path,
        RenameFlags::RENAME_NOREPLACE,
    ) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EEXIST) => Ok(false),
        Err(e) => Err(crate::Error::Io {
            op: "placing",
            path: path.to_owned(),
            cause: e.into(),
        }),
    }
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
    let mut text = serde_json::to_vec(&holder.fitted()).unwrap_or_default();
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
