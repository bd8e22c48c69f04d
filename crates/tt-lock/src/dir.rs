use std::ffi::CString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The variable that names the lock directory.
pub const LOCK_DIR_ENV: &str = "TORCHTOOLS_LOCK_DIR";

/// The lock directory when [`LOCK_DIR_ENV`] is unset: a fixed path rather than
/// `$TMPDIR`, so that every user of the machine meets the same locks.
pub const DEFAULT_LOCK_DIR: &str = "/tmp/torchtools-locks";

/// The lock directory's path from the environment, by the one rule every reader keeps:
/// [`LOCK_DIR_ENV`] when set (empty or relative is an error naming it), else
/// [`DEFAULT_LOCK_DIR`]. Nothing is opened or created.
pub fn path_from_env() -> Result<PathBuf> {
    path_and_origin_from_env().map(|(path, _)| path)
}

/// [`path_from_env`], and where the path came from (the variable is read once).
fn path_and_origin_from_env() -> Result<(PathBuf, Origin)> {
    let Some(value) = std::env::var_os(LOCK_DIR_ENV) else {
        return Ok((PathBuf::from(DEFAULT_LOCK_DIR), Origin::Default));
    };
    let text = value.to_string_lossy().into_owned();
    let path = PathBuf::from(&value);
    if text.trim().is_empty() || !path.is_absolute() {
        return Err(Error::LockDir {
            path,
            origin: format!("{LOCK_DIR_ENV}={text:?}"),
            reason: "it must be an absolute path".into(),
        });
    }
    Ok((path, Origin::Env(text)))
}

/// The directory that holds one lock file per GPU.
#[derive(Debug, Clone)]
pub struct LockDir {
    path: PathBuf,
    origin: Origin,
    /// The usage log, opened for appending at its first record and kept (each record is
    /// then one `write`).
    pub(crate) usage_log: std::sync::Arc<std::sync::OnceLock<Option<crate::file::OwnLog>>>,
    /// A handle on the directory kept open for listing it (see [`LockDir::names`]).
    listing: std::sync::Arc<std::sync::Mutex<Option<nix::dir::Dir>>>,
    /// Whether the queue is known to be empty without listing the directory (see
    /// [`crate::watch::QueueWatch`]).
    pub(crate) queue_watch: std::sync::Arc<std::sync::Mutex<crate::watch::QueueWatch>>,
}

/// Where the lock directory's path came from, for error messages.
#[derive(Debug, Clone)]
enum Origin {
    Env(String),
    Default,
    Given,
}

impl LockDir {
    /// The names in the directory, through a handle kept open and rewound for each
    /// listing (the queue is listed at every request: two `getdents` and an `lseek`
    /// instead of also an `open`, an `fstat` and a `close`).
    pub(crate) fn names(&self) -> Result<Vec<std::ffi::OsString>> {
        use nix::fcntl::OFlag;
        use std::os::unix::ffi::OsStrExt;
        let cannot = |e: nix::Error| self.error(format!("cannot list it: {e}"));
        let mut guard = self.listing.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            *guard = Some(
                nix::dir::Dir::open(self.path(), flags, nix::sys::stat::Mode::empty())
                    .map_err(cannot)?,
            );
        }
        let mut names = Vec::new();
        if let Some(dir) = guard.as_mut() {
            // The iterator rewinds the directory when dropped.
            for entry in dir.iter() {
                let entry = entry.map_err(cannot)?;
                names.push(std::ffi::OsStr::from_bytes(entry.file_name().to_bytes()).to_owned());
            }
        }
        Ok(names)
    }

    /// The directory named by `TORCHTOOLS_LOCK_DIR`, or [`DEFAULT_LOCK_DIR`]; created
    /// (mode 01777) when missing, and checked (see [`LockDir::open`]).
    pub fn from_env() -> Result<LockDir> {
        let (path, origin) = path_and_origin_from_env()?;
        LockDir::open_inner(path, origin)
    }

    /// Opens `path` as the lock directory, creating it with mode 01777 (sticky,
    /// writable by all, like `/tmp`) when it does not exist.
    ///
    /// Refused: a symbolic link (give the real directory), something that is not a
    /// directory, a directory writable by everyone without the sticky bit (anyone could
    /// replace another user's lock file), and a directory this user cannot write.
    pub fn open(path: impl Into<PathBuf>) -> Result<LockDir> {
        LockDir::open_inner(path.into(), Origin::Given)
    }

    fn open_inner(path: PathBuf, origin: Origin) -> Result<LockDir> {
        let dir = LockDir {
            path,
            origin,
            usage_log: Default::default(),
            listing: Default::default(),
            queue_watch: Default::default(),
        };
        match fs::symlink_metadata(&dir.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => dir.create()?,
            Err(e) => return Err(dir.error(format!("cannot read it: {e}"))),
            Ok(_) => {}
        }
        dir.check()?;
        if let Some(warning) = dir.owner_warning() {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::warn!("{warning}"));
        }
        Ok(dir)
    }

    /// What is wrong with the directory's owner, when it is neither root nor this user:
    /// the owner of a sticky directory may delete any file in it, so another ordinary
    /// user who created it first (after a reboot emptied `/tmp`, say) could delete every
    /// user's locks and records. Said (once per process, as a warning) by every program
    /// that opens it, with the fix: root's one-time set-up (`systemd-tmpfiles`, see the
    /// README), or a directory of one's own in `TORCHTOOLS_LOCK_DIR`.
    pub fn owner_warning(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let owner = fs::symlink_metadata(&self.path).ok()?.uid();
        if owner == 0 || owner == crate::owner::euid() {
            return None;
        }
        Some(format!(
            "the lock directory {} belongs to {} (uid {owner}), who can delete every \
             user's locks and records in it: ask root to create it once, owned by root, \
             with the line `d {} 1777 root root -` in /etc/tmpfiles.d/torchtools.conf \
             (then `systemd-tmpfiles --create`), or set {LOCK_DIR_ENV} to a directory \
             root or you own",
            self.path.display(),
            crate::owner::name_of_uid(owner),
            self.path.display(),
        ))
    }

    fn create(&self) -> Result<()> {
        match fs::DirBuilder::new()
            .recursive(true)
            .mode(0o1777)
            .create(&self.path)
        {
            Ok(()) => {
                // The umask trimmed the mode; only the creator may (and needs to) fix it.
                let meta = fs::symlink_metadata(&self.path)
                    .map_err(|e| self.error(format!("cannot read it after creating it: {e}")))?;
                if meta.uid() == crate::owner::euid() {
                    fs::set_permissions(&self.path, Permissions::from_mode(0o1777)).map_err(
                        |e| self.error(format!("cannot make it mode 1777 after creating it: {e}")),
                    )?;
                }
                Ok(())
            }
            // (Another process creating the directory first is Ok for create_dir_all;
            // something else created there first is caught by the check that follows.)
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(self.error(format!("cannot create it: {e}"))),
        }
    }

    fn check(&self) -> Result<()> {
        let meta = fs::symlink_metadata(&self.path)
            .map_err(|e| self.error(format!("cannot read it: {e}")))?;
        if meta.file_type().is_symlink() {
            let target = fs::canonicalize(&self.path)
                .map(|t| format!(" (to {})", t.display()))
                .unwrap_or_default();
            return Err(Error::Unsafe {
                path: self.path.clone(),
                reason: format!(
                    "the lock directory is a symbolic link{target}: anyone could plant one \
                     in a shared /tmp; set {LOCK_DIR_ENV} to the real directory"
                ),
            });
        }
        if !meta.is_dir() {
            return Err(self.error("it is not a directory".into()));
        }
        let mode = meta.mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(Error::Unsafe {
                path: self.path.clone(),
                reason: format!(
                    "the lock directory is writable by everyone but not sticky (mode {:o}), so \
                     any user could delete or replace another user's lock; run \
                     `chmod +t {}` or use another {LOCK_DIR_ENV}",
                    mode & 0o7777,
                    self.path.display()
                ),
            });
        }
        let c_path = CString::new(self.path.as_os_str().as_bytes())
            .map_err(|_| self.error("the path contains a NUL byte".into()))?;
        // SAFETY: c_path is a valid NUL-terminated string for the duration of the call.
        if unsafe { libc::access(c_path.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
            return Err(self.error(format!(
                "this user cannot create files in it (mode {:o}, owner uid {}): {}",
                mode & 0o7777,
                meta.uid(),
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn error(&self, reason: String) -> Error {
        Error::LockDir {
            path: self.path.clone(),
            origin: match &self.origin {
                Origin::Env(v) => format!("{LOCK_DIR_ENV}={v:?}"),
                Origin::Default => format!("the default: {LOCK_DIR_ENV} is unset"),
                Origin::Given => "given by the program".into(),
            },
            reason,
        }
    }

    /// Opens (or creates, mode 0644 whatever the umask) one lock file, for reading
    /// only, refusing symbolic links: a lock is taken on any descriptor, and nothing in
    /// a lock file is read, so another user's writes to it (or its creator's) change
    /// nothing. The descriptor is close-on-exec. Its type is left to the caller, who
    /// checks it on a `statx` of its own (the lock's, made after the `flock`): a FIFO
    /// is opened without blocking, a directory not at all.
    pub(crate) fn open_file(&self, name: &str) -> Result<File> {
        let path = self.path.join(name);
        loop {
            // Open an existing file first, without O_CREAT: with fs.protected_regular
            // (systemd's default), O_CREAT on another user's file in a sticky directory
            // is refused even though the file itself is readable.
            let existing = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(&path);
            let file = match existing {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    match OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create_new(true)
                        .mode(0o644)
                        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                        .open(&path)
                    {
                        Ok(file) => {
                            file.set_permissions(Permissions::from_mode(0o644))
                                .map_err(|source| Error::Io {
                                    op: "making the lock file readable by every user (0644)",
                                    path: path.clone(),
                                    cause: source,
                                })?;
                            file
                        }
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                        Err(e) => return Err(self.open_error(&path, e)),
                    }
                }
                Err(e) => return Err(self.open_error(&path, e)),
            };
            warn_of_lock_file_owner(&file, &path);
            return Ok(file);
        }
    }

    fn open_error(&self, path: &Path, e: io::Error) -> Error {
        // A directory cannot even be opened for writing: the same refusal as a FIFO's.
        if e.raw_os_error() == Some(libc::EISDIR) {
            return crate::file::not_a_regular_file(path.to_owned());
        }
        if e.raw_os_error() == Some(libc::ELOOP) {
            return Error::Unsafe {
                path: path.to_owned(),
                reason: "the lock path is a symbolic link, which is never followed; remove it"
                    .into(),
            };
        }
        if e.kind() == io::ErrorKind::PermissionDenied {
            let owner = fs::symlink_metadata(path).map_or_else(
                |_| "its owner".to_owned(),
                |m| format!("its owner ({})", crate::owner::name_of_uid(m.uid())),
            );
            return self.error(format!(
                "{} cannot be opened ({e}); lock files must be readable by every user so \
                 that every user can lock them: ask {owner} or root to `chmod 644` it",
                path.display()
            ));
        }
        Error::Io {
            op: "opening",
            path: path.to_owned(),
            cause: e,
        }
    }
}

/// Warns (once per process) when a GPU's lock file belongs to another ordinary user:
/// the owner of a file in a sticky directory may delete it, and a lock file deleted
/// while one job holds it lets the next request create a new one and take the GPU too.
/// Root's one-time set-up (the README's) makes every lock file root's.
fn warn_of_lock_file_owner(file: &File, path: &Path) {
    let Ok(meta) = file.metadata() else { return };
    let owner = meta.uid();
    if owner == 0 || owner == crate::owner::euid() {
        return;
    }
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!(
            "the lock file {} belongs to {} (uid {owner}), who can delete it while \
             another user holds the GPU: ask root to create the lock files once (`sudo \
             torchtools reserve --gpu N --no-fence -- true` for each GPU, as the README's \
             set-up for a shared server shows)",
            path.display(),
            crate::owner::name_of_uid(owner)
        )
    });
}

#[cfg(test)]
mod tests {

    use super::*;

    fn given(path: &Path) -> LockDir {
        LockDir {
            usage_log: Default::default(),
            listing: Default::default(),
            queue_watch: Default::default(),
            path: path.to_owned(),
            origin: Origin::Given,
        }
    }

    #[test]
    fn something_put_in_the_directorys_place_before_mkdir_is_named_by_the_check() {
        // A symbolic link planted between the existence check and mkdir: mkdir says
        // "exists", and the check that follows refuses it for what it is.
        let tmp = tempfile::tempdir().unwrap();
        let planted = tmp.path().join("locks");
        std::os::unix::fs::symlink(tmp.path().join("elsewhere"), &planted).unwrap();
        let dir = given(&planted);
        dir.create().unwrap();
        let e = dir.check().unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    #[test]
    fn processes_creating_one_lock_file_at_once_all_open_it() {
        // Whoever loses the O_EXCL race opens the winner's file instead of failing.
        let tmp = tempfile::tempdir().unwrap();
        let dir = given(tmp.path());
        const THREADS: usize = 4;
        for round in 0..300 {
            let name = format!("gpu-{round}.lock");
            let start = std::sync::Barrier::new(THREADS);
            let inodes: Vec<u64> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..THREADS)
                    .map(|_| {
                        s.spawn(|| {
                            start.wait();
                            let file = dir.open_file(&name).unwrap();
                            file.metadata().unwrap().ino()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(inodes.iter().all(|&i| i == inodes[0]), "{inodes:?}");
        }
    }

    #[test]
    fn a_directory_where_the_kernel_refuses_new_files_is_an_error_not_a_retry() {
        // sysfs refuses to create files, also for root (EACCES), after an open without
        // O_CREAT said "no such file": the error comes back at once.
        let sys = Path::new("/sys/kernel");
        assert!(sys.is_dir(), "this test needs sysfs mounted at /sys");
        let e = tt_testkit::hang::within(
            std::time::Duration::from_secs(120),
            "opening a lock file in /sys/kernel",
            || given(sys).open_file("gpu-0.lock").unwrap_err(),
        );
        assert!(e.to_string().contains("gpu-0.lock"), "{e}");
    }
}
