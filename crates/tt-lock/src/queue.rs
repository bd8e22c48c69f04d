//! The first-come-first-served queue of GPU requests, kept in the lock directory itself
//! with no daemon.
//!
//! A request that cannot be granted at once takes a ticket: a file `wait-<N>.json` whose
//! number is one more than every ticket present (taken under an `flock` of the
//! directory), holding the request as JSON, and itself `flock`ed by its waiter for as
//! long as it waits. The kernel releases that lock when the waiter dies however it dies,
//! so a ticket whose lock is free is a dead request and is ignored (and removed by its
//! owner's user). Waiters sleep on inotify events of the directory: a lock file closed
//! by a holder that lets go (or dies), a ticket removed; a fallback re-check every
//! [`FALLBACK_RECHECK`] covers what inotify does not report.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::time::TimeSpec;
use serde::{Deserialize, Serialize};
use tt_device::Bytes;

use crate::file::{open_to_read, probe_held};
use crate::{GpuKey, Holder, LockDir, Result};

/// What a request waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Wants {
    /// All of these GPUs at once.
    Gpus {
        /// The GPUs.
        gpus: Vec<GpuKey>,
    },
    /// `count` of these GPUs: the free ones with the most free memory (`--gpu auto`).
    Auto {
        /// How many.
        count: usize,
        /// The GPUs it may take, most free memory first.
        among: Vec<GpuKey>,
    },
    /// A share of one GPU's memory beside other sharers ([`LockDir::lock_shared`]).
    Share {
        /// The GPU.
        gpu: GpuKey,
        /// The budget asked for.
        bytes: Bytes,
        /// The GPU's memory, within which the sharers' budgets must fit.
        capacity: Bytes,
    },
}

impl Wants {
    /// Every GPU the request waits for: no later request takes one of them before this
    /// request is served (an `auto` request waits for all its candidates).
    pub fn gpus(&self) -> &[GpuKey] {
        match self {
            Wants::Gpus { gpus } => gpus,
            Wants::Auto { among, .. } => among,
            Wants::Share { gpu, .. } => std::slice::from_ref(gpu),
        }
    }
}

impl fmt::Display for Wants {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wants::Gpus { gpus } => {
                let names: Vec<String> = gpus.iter().map(short_name).collect();
                f.write_str(&names.join(" + "))
            }
            Wants::Auto { count, among } => write!(f, "auto: {count} of {} GPU(s)", among.len()),
            Wants::Share {
                gpu,
                bytes,
                capacity,
            } => write!(f, "a share of {bytes} of {} ({capacity})", short_name(gpu)),
        }
    }
}

/// A GPU as the queue shows it: its UUID or `index N`.
fn short_name(key: &GpuKey) -> String {
    match key {
        GpuKey::Uuid(u) => u.clone(),
        GpuKey::Index(i) => format!("index {i}"),
    }
}

/// A request waiting in a lock directory's queue, as [`LockDir::queue`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiter {
    /// Its place in the queue: 1 is served first.
    #[serde(default)]
    pub position: usize,
    /// Its ticket: the order of arrival (larger is later).
    pub ticket: u64,
    /// The waiting process.
    pub pid: u32,
    /// Its user.
    pub user: String,
    /// Its host.
    pub host: String,
    /// When it started waiting, in seconds since the Unix epoch.
    pub since_unix: u64,
    /// GPU memory the job said it needs, when it said.
    #[serde(default)]
    pub reserved: Option<Bytes>,
    /// Command line of the job.
    #[serde(default)]
    pub command: Vec<String>,
    /// What it waits for.
    pub wants: Wants,
    /// Its PID namespace (see [`Holder::pid_ns`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<u64>,
}

impl Waiter {
    fn new(ticket: u64, holder: &Holder, wants: Wants) -> Waiter {
        Waiter {
            position: 0,
            ticket,
            pid: holder.pid,
            user: holder.user.clone(),
            host: holder.host.clone(),
            since_unix: holder.since_unix,
            reserved: holder.reserved,
            command: holder.command.clone(),
            wants,
            pid_ns: holder.pid_ns,
        }
    }

    /// The start of the wait as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn since_utc(&self) -> String {
        crate::holder::utc(self.since_unix)
    }
}

impl fmt::Display for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} pid {}{} ({}@{}) since {} wants {}",
            self.position,
            self.pid,
            crate::holder::namespace_note(self.pid_ns),
            self.user,
            self.host,
            self.since_utc(),
            self.wants
        )
    }
}

/// How often a waiter re-checks the queue when no inotify event came (a holder whose
/// lock file stays open in a forked child after it let go makes no event).
pub(crate) const FALLBACK_RECHECK: Duration = Duration::from_millis(100);

const TICKET_PREFIX: &str = "wait-";
const TICKET_SUFFIX: &str = ".json";

/// The ticket number a file name stands for, if it is a ticket.
fn ticket_of(name: &OsStr) -> Option<u64> {
    let digits = name
        .to_str()?
        .strip_prefix(TICKET_PREFIX)?
        .strip_suffix(TICKET_SUFFIX)?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

fn ticket_name(ticket: u64) -> String {
    format!("{TICKET_PREFIX}{ticket:020}{TICKET_SUFFIX}")
}

/// This process's place in the queue: the ticket file, locked for as long as it waits;
/// dropping it leaves the queue.
#[derive(Debug)]
pub(crate) struct Ticket {
    file: File,
    path: PathBuf,
    number: u64,
}

impl Ticket {
    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// Whether the ticket is still in the directory (a `/tmp` cleaner may delete it).
    pub(crate) fn is_in_place(&self) -> bool {
        crate::file::same_file(&self.file, &self.path)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.is_in_place() {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// The lock directory's own `flock`, held while a ticket is numbered and placed, and
/// while a dead ticket is removed, so that a number is never given twice.
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    pub(crate) fn take(dir: &LockDir) -> Result<DirLock> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(dir.path())
            .map_err(|e| dir.error(format!("cannot open it to queue a request: {e}")))?;
        loop {
            // SAFETY: the fd is open for the duration of the call.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(DirLock { _file: file });
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(dir.error(format!("cannot lock it to queue a request: {e}")));
            }
        }
    }
}

impl LockDir {
    /// The requests waiting for GPUs in this directory, first served first. A request
    /// whose process died (however: `kill -9`, the OOM killer) is not listed, nor a
    /// ticket that names another user than its file's owner ([`LockDir::ignored`]).
    pub fn queue(&self) -> Result<Vec<Waiter>> {
        self.scan_queue(None)
    }

    /// Live tickets in order; `own` is this process's ticket, listed without re-reading.
    pub(crate) fn scan_queue(&self, own: Option<u64>) -> Result<Vec<Waiter>> {
        Ok(self.scan_queue_checked(own)?.0)
    }

    /// [`LockDir::scan_queue`], and the tickets ignored because they name another user
    /// than their file's owner (they are no request: nobody waits behind them).
    pub(crate) fn scan_queue_checked(
        &self,
        own: Option<u64>,
    ) -> Result<(Vec<Waiter>, Vec<crate::Ignored>)> {
        // Held through the listing: another thread's listing must not read away an
        // event that this one's verdict depends on.
        let mut watch = self.queue_watch.lock().unwrap_or_else(|e| e.into_inner());
        if own.is_none() && watch.still_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut ignored = Vec::new();
        let armed = watch.arm(self.path());
        let mut waiters = Vec::new();
        for name in self.names()? {
            let Some(ticket) = ticket_of(&name) else {
                continue;
            };
            if Some(ticket) == own {
                continue;
            }
            let path = self.path().join(&name);
            let Some((file, meta)) = open_to_read(&path) else {
                continue; // gone since, or not a ticket to read
            };
            if !probe_held(&file) {
                self.remove_dead(&file, &path, meta.uid());
                continue;
            }
            let Some(mut waiter) = crate::file::read_record::<Waiter>(&file) else {
                continue;
            };
            if let Err(why) = crate::owner::check(&path, meta.uid(), &waiter.user) {
                ignored.push(why);
                continue;
            }
            waiter.ticket = ticket;
            waiters.push(waiter);
        }
        waiters.sort_by_key(|w| w.ticket);
        for (i, w) in waiters.iter_mut().enumerate() {
            w.position = i + 1;
        }
        // Empty only without a ticket of our own (which is live, though not listed).
        watch.empty = armed && own.is_none() && waiters.is_empty() && ignored.is_empty();
        Ok((waiters, ignored))
    }

    /// Removes a dead request's ticket when this user may (its own; the sticky
    /// directory keeps other users' files), under the directory lock, so that a new
    /// ticket given the same number meanwhile is never removed.
    fn remove_dead(&self, file: &File, path: &Path, owner: u32) {
        if owner != nix::unistd::geteuid().as_raw() {
            return;
        }
        let Ok(_guard) = DirLock::take(self) else {
            return;
        };
        if crate::file::same_file(file, path) && !probe_held(file) {
            let _ = fs::remove_file(path);
        }
    }

    /// Takes a place at the end of the queue.
    pub(crate) fn enqueue(&self, holder: &Holder, wants: &Wants) -> Result<Ticket> {
        let guard = DirLock::take(self)?;
        let entries =
            fs::read_dir(self.path()).map_err(|e| self.error(format!("cannot list it: {e}")))?;
        let last = entries
            .flatten()
            .filter_map(|e| ticket_of(&e.file_name()))
            .max()
            .unwrap_or(0);
        let number = last + 1;
        let waiter = Waiter::new(number, holder, wants.clone());
        let mut text = serde_json::to_vec(&waiter).unwrap_or_default();
        text.push(b'\n');
        // Written and locked under a name the queue ignores, then renamed: a ticket is
        // never seen unlocked or half written.
        let temp = self
            .path()
            .join(format!(".wait-{}-{number}.tmp", std::process::id()));
        let path = self.path().join(ticket_name(number));
        let file = crate::file::create_locked(&temp, &path, &text, "creating the queue ticket")?;
        drop(guard);
        Ok(Ticket { file, path, number })
    }
}

/// Wakes a waiter when something in the lock directory may have changed who can be
/// served: a file open for writing closed (a holder let go or died, a waiter died), or
/// a ticket removed.
pub(crate) struct Watch {
    fd: Option<Inotify>,
}

thread_local! {
    /// Each thread's watches, one per lock directory, kept for the thread's life:
    /// closing an inotify descriptor waits for a kernel grace period (milliseconds),
    /// which would land on every hand-off.
    static WATCHES: RefCell<Vec<(PathBuf, Rc<Watch>)>> = const { RefCell::new(Vec::new()) };
}

// Left out of mutation testing: the inotify watch that wakes a waiting request as
// soon as the queue or a lock changes; without it (or with its reads and waits
// mutated) requests are still served, by the 100 ms re-check: only the hand-off's
// speed changes, which the lock benchmark measures.
#[cfg_attr(mutants, mutants::skip)]
impl Watch {
    /// This thread's watch of `dir`, with no event pending; without inotify (other
    /// systems, or the user's inotify limit reached) waits are plain sleeps.
    pub(crate) fn of(dir: &Path) -> Rc<Watch> {
        WATCHES.with(|watches| {
            let mut watches = watches.borrow_mut();
            if let Some((_, watch)) = watches.iter().find(|(p, _)| p == dir) {
                watch.drain();
                return Rc::clone(watch);
            }
            let watch = Rc::new(Watch {
                fd: inotify_watch(dir),
            });
            if watch.fd.is_some() {
                watches.push((dir.to_owned(), Rc::clone(&watch)));
            }
            watch
        })
    }

    /// Reads away the events pending: only that one came matters, not which.
    fn drain(&self) {
        if let Some(inotify) = &self.fd {
            // Non-blocking: EAGAIN once nothing is left.
            while inotify.read_events().is_ok_and(|events| !events.is_empty()) {}
        }
    }

    /// Sleeps until an event or for `limit`, whichever comes first (never longer than
    /// [`FALLBACK_RECHECK`] with inotify, 2 ms without).
    pub(crate) fn wait(&self, limit: Duration) {
        let Some(inotify) = &self.fd else {
            std::thread::sleep(limit.min(Duration::from_millis(2)));
            return;
        };
        let limit = limit.min(FALLBACK_RECHECK);
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        let timeout = TimeSpec::from_duration(limit);
        if ppoll(&mut fds, Some(timeout), None).is_ok_and(|n| n > 0) {
            // Drain the events: their content does not matter, only that one came.
            self.drain();
        }
    }
}

// Left out of mutation testing: see `impl Watch`.
#[cfg_attr(mutants, mutants::skip)]
fn inotify_watch(dir: &Path) -> Option<Inotify> {
    let inotify = match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
        Ok(i) => i,
        Err(e) => {
            tracing::debug!("no inotify ({e}): queue waits poll");
            return None;
        }
    };
    let mask = AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_ONLYDIR;
    if let Err(e) = inotify.add_watch(dir, mask) {
        tracing::debug!("cannot watch {} ({e}): queue waits poll", dir.display());
        return None;
    }
    Some(inotify)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_is_never_locked_through_a_symlink_put_in_the_directorys_place() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("locks");
        let dir = LockDir::open(&path).unwrap();
        drop(DirLock::take(&dir).unwrap());
        // Swapped for a symbolic link after the directory was checked.
        fs::rename(&path, tmp.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("moved"), &path).unwrap();
        let e = DirLock::take(&dir).err().unwrap();
        assert!(
            e.to_string().contains("cannot open it to queue a request"),
            "{e}"
        );
    }

    #[test]
    fn a_waiter_reads_as_one_line_of_torchtools_queue() {
        let waiter = Waiter {
            position: 2,
            ticket: 9,
            pid: 42,
            user: "ada".into(),
            host: "gpu1".into(),
            since_unix: 951_782_400,
            reserved: None,
            command: vec![],
            pid_ns: None,
            wants: Wants::Auto {
                count: 2,
                among: vec![],
            },
        };
        assert_eq!(waiter.since_utc(), "2000-02-29 00:00:00 UTC");
        assert_eq!(
            waiter.to_string(),
            format!(
                "#2 pid 42 (ada@gpu1) since 2000-02-29 00:00:00 UTC wants {}",
                waiter.wants
            )
        );
    }

    #[test]
    fn ticket_names_round_trip_and_others_are_ignored() {
        assert_eq!(ticket_name(7), "wait-00000000000000000007.json");
        assert_eq!(ticket_of(OsStr::new(&ticket_name(7))), Some(7));
        assert_eq!(
            ticket_of(OsStr::new(&ticket_name(u64::MAX))),
            Some(u64::MAX)
        );
        for other in [
            "wait-7.json",
            "wait-0000000000000000000x.json",
            ".wait-12-7.tmp",
            "gpu-0.lock",
            "wait-00000000000000000007.jsonx",
        ] {
            assert_eq!(ticket_of(OsStr::new(other)), None, "{other}");
        }
    }

    #[test]
    fn what_a_request_wants_reads_as_users_name_gpus() {
        let gpus = Wants::Gpus {
            gpus: vec![GpuKey::Index(0), GpuKey::Uuid("GPU-ab".into())],
        };
        assert_eq!(gpus.to_string(), "index 0 + GPU-ab");
        assert_eq!(gpus.gpus().len(), 2);
        let auto = Wants::Auto {
            count: 2,
            among: vec![GpuKey::Index(0), GpuKey::Index(1), GpuKey::Index(2)],
        };
        assert_eq!(auto.to_string(), "auto: 2 of 3 GPU(s)");
        assert_eq!(auto.gpus().len(), 3);
        let json = serde_json::to_string(&auto).unwrap_or_default();
        assert_eq!(
            json,
            r#"{"kind":"auto","count":2,"among":[{"index":0},{"index":1},{"index":2}]}"#
        );
    }

    #[test]
    fn tickets_are_numbered_in_arrival_order_and_leave_when_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let wants = Wants::Gpus {
            gpus: vec![GpuKey::Index(0)],
        };
        let holder = Holder::current().reserving(Bytes::gib(3));
        let a = dir.enqueue(&holder, &wants).unwrap();
        let b = dir.enqueue(&holder, &wants).unwrap();
        assert!(b.number() > a.number());
        let queue = dir.queue().unwrap();
        assert_eq!(
            queue
                .iter()
                .map(|w| (w.position, w.ticket))
                .collect::<Vec<_>>(),
            vec![(1, a.number()), (2, b.number())]
        );
        assert_eq!(queue[0].reserved, Some(Bytes::gib(3)));
        assert_eq!(queue[0].pid, std::process::id());
        assert_eq!(queue[0].wants, wants);
        // This process's own ticket is left out when it asks for the others.
        assert_eq!(dir.scan_queue(Some(a.number())).unwrap().len(), 1);
        drop(a);
        let queue = dir.queue().unwrap();
        assert_eq!(queue.len(), 1);
        assert_eq!((queue[0].position, queue[0].ticket), (1, b.number()));
        // No temporary file is left behind.
        drop(b);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert!(names.is_empty(), "{names:?}");
    }

    #[test]
    fn a_ticket_nobody_holds_is_a_dead_request_and_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let waiter = Waiter::new(
            3,
            &Holder::current(),
            Wants::Gpus {
                gpus: vec![GpuKey::Index(0)],
            },
        );
        let path = dir.path().join(ticket_name(3));
        fs::write(&path, serde_json::to_vec(&waiter).unwrap()).unwrap();
        assert!(dir.queue().unwrap().is_empty());
        assert!(!path.exists(), "this user's dead ticket is removed");
        // Numbering goes on after the largest ticket present, dead or alive.
        fs::write(&path, serde_json::to_vec(&waiter).unwrap()).unwrap();
        let t = dir.enqueue(&Holder::current(), &waiter.wants).unwrap();
        assert_eq!(t.number(), 4);
    }
}
