use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tt_device::{Inventory, NvmlStatus};

use crate::{Error, GpuKey, Holder, LockDir, Result};

/// The variable through which `torchtools reserve` hands its locks to the command it
/// runs: `<lock file name>=<fd>` pairs separated by commas. A process that finds its
/// GPU's lock there uses the inherited lock instead of waiting for itself.
pub const HELD_LOCKS_ENV: &str = "TORCHTOOLS_HELD_LOCKS";

/// How to wait for a lock that someone else holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Fail at once with [`Error::WouldBlock`], naming the holder.
    Try,
    /// Wait as long as it takes (the kernel wakes the waiter when the lock is released).
    Block,
    /// Wait at most this long, then fail with [`Error::Timeout`], naming the holder.
    /// It never returns early, and returns within about 2 ms after the deadline.
    Timeout(Duration),
}

/// The longest sleep between two attempts of a timed wait: bounds both the overshoot
/// past the deadline and the hand-off delay of a timed waiter.
const MAX_POLL: Duration = Duration::from_millis(2);
const FIRST_POLL: Duration = Duration::from_micros(50);

/// A held GPU lock: released when dropped, or by the kernel when the process dies.
#[derive(Debug)]
#[must_use = "the lock is released when it is dropped: hold it while using the GPU"]
pub struct GpuLock {
    file: File,
    key: GpuKey,
    path: PathBuf,
    holder: Holder,
    inherited: bool,
    // Declared last: dropped after the unlock in `Drop`.
    _registered: Option<Registered>,
}

/// The lock files this process holds (taken here, not inherited).
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// This process's claim on one lock path, from before its lock is taken until after it
/// is released.
#[derive(Debug)]
struct Registered(PathBuf);

impl Registered {
    fn new(path: &Path) -> Option<Registered> {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if held.iter().any(|p| p == path) {
            return None;
        }
        held.push(path.to_owned());
        Some(Registered(path.to_owned()))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|p| p != &self.0);
    }
}

impl GpuLock {
    /// The GPU.
    pub fn key(&self) -> &GpuKey {
        &self.key
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The record written into the lock file.
    pub fn holder(&self) -> &Holder {
        &self.holder
    }

    /// Whether this lock was inherited from a parent (`torchtools reserve`) rather than
    /// taken here; dropping it then leaves the parent's lock in place.
    pub fn is_inherited(&self) -> bool {
        self.inherited
    }

    /// Rewrites the holder record (for example to add the pid of the command the lock
    /// was handed to). The GPU field is kept.
    pub fn set_holder(&mut self, mut holder: Holder) -> Result<()> {
        holder.gpu = self.holder.gpu.clone();
        write_holder(&self.file, &self.path, &holder)?;
        self.holder = holder;
        Ok(())
    }
}

impl AsRawFd for GpuLock {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Drop for GpuLock {
    fn drop(&mut self) {
        if !self.inherited {
            // Explicit unlock: a child forked without exec may still hold a copy of the
            // descriptor, and must not keep the GPU locked after we let go. (The
            // inherited case must not unlock: the lock belongs to the parent.)
            // SAFETY: the fd is open for as long as self.file lives.
            unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// Lets `command` inherit `locks`: their descriptors stay open across its `exec`, and
/// [`HELD_LOCKS_ENV`] tells it which they are. The GPUs stay locked for as long as
/// either this process or the command lives; a `kill -9` of this process alone does not
/// free a GPU the command still uses.
pub fn share_with(command: &mut Command, locks: &[GpuLock]) {
    let fds: Vec<RawFd> = locks.iter().map(AsRawFd::as_raw_fd).collect();
    let value = locks
        .iter()
        .map(|l| format!("{}={}", l.key.file_name(), l.file.as_raw_fd()))
        .collect::<Vec<_>>()
        .join(",");
    command.env(HELD_LOCKS_ENV, value);
    // SAFETY: the closure runs in the forked child before exec and only calls fcntl,
    // which is async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

impl LockDir {
    /// Locks one GPU. `holder` is written into the lock file (its `gpu` is filled in).
    ///
    /// If this process inherited the lock from `torchtools reserve`
    /// ([`HELD_LOCKS_ENV`]), that lock is returned at once.
    pub fn lock(&self, key: &GpuKey, wait: Wait, holder: Holder) -> Result<GpuLock> {
        let deadline = match wait {
            Wait::Timeout(d) => Some((Instant::now(), d)),
            _ => None,
        };
        self.lock_until(key, wait, deadline, holder)
    }

    fn lock_until(
        &self,
        key: &GpuKey,
        wait: Wait,
        deadline: Option<(Instant, Duration)>,
        mut holder: Holder,
    ) -> Result<GpuLock> {
        holder.gpu = key.cuda_visible_entry();
        let name = key.file_name();
        let path = self.path().join(&name);
        if let Some(lock) = self.inherited(key, &path, &holder)? {
            return Ok(lock);
        }
        // A second lock of the same file in one process would wait for itself forever.
        let registered =
            Registered::new(&path).ok_or_else(|| Error::AlreadyHeld { gpu: key.clone() })?;
        loop {
            let file = self.open_file(&name)?;
            match wait {
                Wait::Try => {
                    if !try_flock(&file, &path)? {
                        return Err(Error::WouldBlock {
                            gpu: key.clone(),
                            holder: read_holder(&file).map(Box::new),
                        });
                    }
                }
                Wait::Block => {
                    if !try_flock(&file, &path)? {
                        tracing::info!(
                            "waiting for {key}, held by {}",
                            read_holder(&file)
                                .map_or("an unknown process".into(), |h| h.to_string())
                        );
                        flock_blocking(&file, &path)?;
                    }
                }
                Wait::Timeout(_) => {
                    let (start, limit) = deadline.unwrap_or((Instant::now(), Duration::ZERO));
                    let mut pause = FIRST_POLL;
                    while !try_flock(&file, &path)? {
                        let waited = start.elapsed();
                        if waited >= limit {
                            return Err(Error::Timeout {
                                gpu: key.clone(),
                                waited,
                                holder: read_holder(&file).map(Box::new),
                            });
                        }
                        std::thread::sleep(pause.min(limit - waited));
                        pause = (pause * 2).min(MAX_POLL);
                    }
                }
            }
            // The file may have been replaced while we waited (a lock file deleted by a
            // /tmp cleaner and created anew): then our lock is on an orphan; start over.
            if !same_file(&file, &path) {
                continue;
            }
            write_holder(&file, &path, &holder)?;
            return Ok(GpuLock {
                file,
                key: key.clone(),
                path,
                holder,
                inherited: false,
                _registered: Some(registered),
            });
        }
    }

    /// Locks several GPUs, all or nothing: in a fixed order (so two processes asking
    /// for overlapping sets cannot deadlock), releasing what it took if one fails. A
    /// timeout covers the whole set.
    pub fn lock_many(&self, keys: &[GpuKey], wait: Wait, holder: Holder) -> Result<Vec<GpuLock>> {
        let mut keys = keys.to_vec();
        keys.sort();
        keys.dedup();
        let deadline = match wait {
            Wait::Timeout(d) => Some((Instant::now(), d)),
            _ => None,
        };
        let mut locks = Vec::with_capacity(keys.len());
        for key in &keys {
            // On error, `locks` is dropped here: everything taken so far is released.
            locks.push(self.lock_until(key, wait, deadline, holder.clone())?);
        }
        Ok(locks)
    }

    /// Locks `count` free GPUs among those NVML lists, preferring the most free memory.
    /// All or nothing: when fewer than `count` are free it takes none, and waits as
    /// `wait` says for enough to be free.
    pub fn lock_auto(
        &self,
        inventory: &Inventory,
        count: usize,
        wait: Wait,
        holder: Holder,
    ) -> Result<Vec<GpuLock>> {
        if let NvmlStatus::Unavailable { reason } = &inventory.nvml {
            return Err(Error::NotEnoughGpus {
                count,
                reason: format!(
                    "NVML is unavailable ({reason}), so the GPUs are unknown; name them \
                     (--gpu 0) to lock by index"
                ),
            });
        }
        if inventory.gpus.len() < count || count == 0 {
            return Err(Error::NotEnoughGpus {
                count,
                reason: format!("the machine has {} GPU(s)", inventory.gpus.len()),
            });
        }
        let mut candidates: Vec<_> = inventory.gpus.iter().collect();
        candidates.sort_by(|a, b| b.free.cmp(&a.free).then(a.nvml_index.cmp(&b.nvml_index)));
        let keys: Vec<GpuKey> = candidates
            .iter()
            .map(|g| GpuKey::Uuid(crate::gpu::normalize_uuid(&g.uuid)))
            .collect();
        let start = Instant::now();
        let mut pause = FIRST_POLL;
        loop {
            let mut taken = Vec::new();
            let mut busy = Vec::new();
            for key in &keys {
                match self.lock(key, Wait::Try, holder.clone()) {
                    Ok(lock) => {
                        taken.push(lock);
                        if taken.len() == count {
                            return Ok(taken);
                        }
                    }
                    Err(Error::WouldBlock { gpu, holder }) => busy.push((gpu, holder)),
                    Err(e) => return Err(e),
                }
            }
            drop(taken);
            let (gpu, holder) = busy.into_iter().next().unwrap_or((keys[0].clone(), None));
            match wait {
                Wait::Try => return Err(Error::WouldBlock { gpu, holder }),
                Wait::Timeout(limit) if start.elapsed() >= limit => {
                    return Err(Error::Timeout {
                        gpu,
                        waited: start.elapsed(),
                        holder,
                    })
                }
                Wait::Timeout(limit) => {
                    std::thread::sleep(pause.min(limit.saturating_sub(start.elapsed())));
                }
                Wait::Block => std::thread::sleep(pause),
            }
            pause = (pause * 2).min(MAX_POLL * 5);
        }
    }

    /// The lock inherited from a parent through [`HELD_LOCKS_ENV`], if it is this GPU's
    /// and its descriptor really is that lock file.
    fn inherited(&self, key: &GpuKey, path: &Path, holder: &Holder) -> Result<Option<GpuLock>> {
        let Some(value) = std::env::var_os(HELD_LOCKS_ENV) else {
            return Ok(None);
        };
        let value = value.to_string_lossy();
        let held: HashMap<&str, &str> = value
            .split(',')
            .filter_map(|pair| pair.split_once('='))
            .collect();
        let Some(fd) = held
            .get(key.file_name().as_str())
            .and_then(|f| f.parse::<RawFd>().ok())
        else {
            return Ok(None);
        };
        // SAFETY: dup of any integer is safe; it fails with EBADF if fd is not open.
        let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if copy < 0 {
            tracing::warn!("{HELD_LOCKS_ENV} names fd {fd} for {key}, but it is not open");
            return Ok(None);
        }
        // SAFETY: `copy` is a fresh descriptor that nothing else owns.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(copy) };
        if !same_file(&file, path) {
            tracing::warn!("{HELD_LOCKS_ENV} names fd {fd} for {key}, but it is another file");
            return Ok(None);
        }
        let holder = read_holder(&file).unwrap_or_else(|| holder.clone());
        Ok(Some(GpuLock {
            file,
            key: key.clone(),
            path: path.to_owned(),
            holder,
            inherited: true,
            _registered: None,
        }))
    }
}

fn try_flock(file: &File, path: &Path) -> Result<bool> {
    // SAFETY: the fd is open for the duration of the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        Some(libc::EINTR) => Ok(false),
        _ => Err(Error::Io {
            op: "locking",
            path: path.to_owned(),
            source: e,
        }),
    }
}

fn flock_blocking(file: &File, path: &Path) -> Result<()> {
    loop {
        // SAFETY: the fd is open for the duration of the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Io {
                op: "locking",
                path: path.to_owned(),
                source: e,
            });
        }
    }
}

/// Whether `file` is still the file at `path` (same device and inode).
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Writes the record in place (then trims the rest), so a reader never sees an empty
/// file between two holders.
fn write_holder(file: &File, path: &Path, holder: &Holder) -> Result<()> {
    let mut text = serde_json::to_vec(holder).unwrap_or_default();
    text.push(b'\n');
    let io_err = |source| Error::Io {
        op: "writing the holder record to",
        path: path.to_owned(),
        source,
    };
    file.write_all_at(&text, 0).map_err(io_err)?;
    file.set_len(text.len() as u64).map_err(io_err)
}

/// The record in a lock file, if it holds a readable one.
pub(crate) fn read_holder(file: &File) -> Option<Holder> {
    let mut buf = vec![0u8; 64 * 1024];
    let n = file.read_at(&mut buf, 0).ok()?;
    let line = buf[..n].split(|&b| b == b'\n').next()?;
    serde_json::from_slice(line).ok()
}
