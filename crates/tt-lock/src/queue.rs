//! The queue of GPU requests, kept in the lock directory itself with no daemon.
//!
//! A request that cannot be granted at once takes a ticket: a file `wait-<N>.json`
//! holding the request as JSON, write-locked by its waiter for as long as it waits
//! ([`crate::file::lock_record`]: a lock only its owner can take, so nobody else can
//! keep a dead request alive). Its number is one more than every live, believed ticket
//! present, and the file is placed under it with `renameat2(RENAME_NOREPLACE)`: when
//! two requests pick the same number, the second finds it taken and takes the next one.
//! The number is only a name: readers order requests by when the kernel placed each
//! ticket (its status change time, set by that rename, which nobody can set back) and
//! count a request's wait from then or from its process's start, whichever is later,
//! never from what the ticket says (`record::bound_who`).
//! No directory-wide lock is taken, so nobody's lock can stop tickets from being
//! numbered. The kernel drops a waiter's lock when the waiter dies however it dies, so a
//! ticket without its lock is a dead request and is ignored (and removed by its owner's
//! user). Waiters sleep on inotify events of the directory: a lock file closed by a
//! holder that lets go (or dies), a ticket removed; a fallback re-check every
//! [`FALLBACK_RECHECK_EVERY`] covers what inotify does not report.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::time::TimeSpec;
use serde::{Deserialize, Serialize};
use tt_device::Bytes;

use crate::file::{open_to_read, record_live};
use crate::record::Floor;
use crate::{GpuKey, Holder, LockDir, Requester, Result};

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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    /// Its place in the queue: 1 is served first.
    #[serde(default)]
    pub position: usize,
    /// Its ticket: the order of arrival (larger is later).
    pub ticket: u64,
    /// The waiting process: who, since when, for what. In the ticket its fields sit
    /// beside the others, as in a [`Holder`]'s record.
    #[serde(flatten)]
    pub who: Requester,
    /// What it waits for.
    pub wants: Wants,
    /// Under a fair-share policy, its priority: higher is served first (see
    /// [`LockDir::queue`]); `None` when served first come, first served. Computed by
    /// the reader, never read from the ticket.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub priority: Option<f64>,
    /// Why it has its place under a fair-share policy: `tt2: 0.4 GPU-h recent use (3%
    /// of all), waited 2m`. Computed by the reader.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// Why the policy holds it back (a per-user limit reached): it blocks nobody and is
    /// served once its user holds less. Computed by the reader.
    #[serde(default, skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
    /// When its ticket was placed, as the kernel stamped it (its status change time):
    /// the order of arrival. Set by the reader, never read from the ticket.
    #[serde(skip)]
    pub(crate) placed: Placed,
}

/// A ticket's placing time, `(seconds, nanoseconds)` since the epoch.
pub(crate) type Placed = (i64, i64);

/// When the ticket whose file's metadata is `meta` was placed: its status change time,
/// which the rename that placed it set (see the module's documentation).
fn placed(meta: &fs::Metadata) -> Placed {
    (meta.ctime(), meta.ctime_nsec())
}

impl Waiter {
    /// Its order of arrival: when its ticket was placed, then (for two placed in the
    /// same nanosecond) its number.
    pub(crate) fn arrival(&self) -> (Placed, u64) {
        (self.placed, self.ticket)
    }
}

impl Waiter {
    pub(crate) fn new(ticket: u64, holder: &Holder, wants: Wants) -> Waiter {
        Waiter {
            position: 0,
            ticket,
            who: holder.who.fitted().into_owned(),
            wants,
            priority: None,
            why: None,
            held: None,
            placed: (0, 0),
        }
    }

    /// The start of the wait as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn since_utc(&self) -> String {
        self.who.since_utc()
    }
}

impl fmt::Display for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = format!(
            "#{} pid {}{} ({}@{}) since {} wants {}",
            self.position,
            self.who.pid,
            crate::holder::namespace_note(self.who.pid_ns),
            self.who.user,
            self.who.host,
            self.since_utc(),
            self.wants
        );
        if let Some(note) = self.who.outside_policy() {
            line.push_str(&format!(", {note}"));
        }
        // Its user and host are its writer's text (see Holder's Display).
        f.write_str(&tt_device::printable(&line))
    }
}

/// How often a waiter re-checks the queue when no inotify event came (a holder whose
/// lock file stays open in a forked child after it let go makes no event).
pub(crate) const FALLBACK_RECHECK_EVERY: Duration = Duration::from_millis(100);

/// The largest ticket number believed. Numbers count up by one per request from the
/// largest live ticket, so no real queue comes near it; a ticket numbered above it is
/// ignored and reported (it would otherwise push every later number past `u64::MAX`).
pub(crate) const MAX_TICKET: u64 = 1 << 53;

/// How many numbers a new ticket tries before giving up: each try that fails found its
/// number taken by a request placed meanwhile, or by a file someone put there.
const PLACING_TRIES: usize = 10_000;

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
    placed: Placed,
}

impl Ticket {
    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// Its order of arrival, as readers see it ([`Waiter::arrival`]).
    pub(crate) fn arrival(&self) -> (Placed, u64) {
        (self.placed, self.number)
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

impl LockDir {
    /// The requests waiting for GPUs in this directory, first served first: by
    /// arrival, or as the machine's policy orders them ([`LockDir::policy`]: fair share
    /// by recent use, each with its [`Waiter::priority`] and [`Waiter::why`]; one held
    /// back by a per-user limit keeps its place with [`Waiter::held`] and blocks
    /// nobody). A request whose process died (however: `kill -9`, the OOM killer) is not
    /// listed, nor a ticket that names another user than its file's owner
    /// ([`LockDir::ignored`]).
    pub fn queue(&self) -> Result<Vec<Waiter>> {
        let waiters = self.scan_queue(None)?;
        self.ordered(&self.policy().policy, waiters)
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
            if !record_live(&file) {
                self.remove_dead(&file, &path, meta.uid());
                continue;
            }
            let Some(mut waiter) = crate::file::read_record::<Waiter>(&file) else {
                continue;
            };
            // Its place and its waiting time come from the kernel, not from the
            // ticket's text: its owner writes that.
            let believed =
                crate::owner::check(&path, meta.uid(), &waiter.who.user).and_then(|()| {
                    crate::record::bound_who(&mut waiter.who, &path, &meta, Floor::Placed)
                });
            if let Err(why) = believed {
                ignored.push(why);
                continue;
            }
            if ticket > MAX_TICKET {
                ignored.push(crate::Ignored::because(
                    &path,
                    meta.uid(),
                    &waiter.who.user,
                    format!("its number {ticket} is above any real queue's ({MAX_TICKET})"),
                ));
                continue;
            }
            waiter.ticket = ticket;
            waiter.placed = placed(&meta);
            waiters.push(waiter);
        }
        // Arrival is when the ticket was placed, as the kernel stamped it; the number
        // (its writer's choice of a free name) only breaks a tie.
        waiters.sort_by_key(Waiter::arrival);
        for (i, w) in waiters.iter_mut().enumerate() {
            w.position = i + 1;
        }
        // Empty only without a ticket of our own (which is live, though not listed).
        watch.empty = armed && own.is_none() && waiters.is_empty() && ignored.is_empty();
        Ok((waiters, ignored))
    }

    /// Removes a dead request's ticket when this user may (its own; the sticky
    /// directory keeps other users' files), under this user's cleaning lock
    /// ([`LockDir::cleaning_lock`]), so that two of this user's processes never race: one
    /// removing the dead ticket, a third placing a new one under the freed number, the
    /// other then removing that. Skipped when another of this user's processes cleans.
    fn remove_dead(&self, file: &File, path: &Path, owner: u32) {
        if owner != crate::owner::euid() {
            return;
        }
        let Some(_cleaning) = self.cleaning_lock() else {
            return;
        };
        if crate::file::same_file(file, path) && !record_live(file) {
            let _ = fs::remove_file(path);
        }
    }

    /// This user's cleaning lock: `.clean-user-<UID>.lock`, this user's own file,
    /// write-locked without waiting; `None` when another of this user's processes holds
    /// it, or when the name is taken by a file that is not this user's (then dead tickets
    /// stay: they count for nothing anyway).
    fn cleaning_lock(&self) -> Option<File> {
        let path = self
            .path()
            .join(format!(".clean-user-{}.lock", crate::owner::euid()));
        crate::file::own_locked(&path).map(|(file, _)| file)
    }

    /// Takes a place at the end of the queue: a ticket placed now (readers order by the
    /// kernel's placing time), under the number after every live, believed ticket's (the
    /// lowest free one when that is past [`MAX_TICKET`]), or the next free one after it
    /// when a request placed meanwhile (or a file someone put there) has it.
    pub(crate) fn enqueue(&self, holder: &Holder, wants: &Wants) -> Result<Ticket> {
        let (live, _) = self.scan_queue_checked(None)?;
        // The number is only a free name (arrival is the kernel's placing time): after
        // the largest believed one, or where a ticket took the largest number believed,
        // the lowest free one, so that nobody's ticket can use up the numbers.
        let mut number = live
            .iter()
            .map(|w| w.ticket)
            .max()
            .map_or(1, |n| n.saturating_add(1));
        if number > MAX_TICKET {
            let taken: std::collections::HashSet<u64> = live.iter().map(|w| w.ticket).collect();
            number = (1..=MAX_TICKET).find(|n| !taken.contains(n)).unwrap_or(1);
        }
        let waiter = Waiter::new(number, holder, wants.clone());
        let mut text = serde_json::to_vec(&waiter).unwrap_or_default();
        text.push(b'\n');
        // Written and locked under a name the queue ignores, then placed without
        // replacing anything: a ticket is never seen unlocked or half written, and a
        // number is never given twice. (The number inside the record is not read: the
        // file's name is the ticket.)
        let temp = self
            .path()
            .join(format!(".wait-{}-{number}.tmp", std::process::id()));
        let (file, temp) =
            crate::file::create_locked_aside(&temp, &text, "creating the queue ticket")?;
        let mut taken: Option<std::collections::HashSet<u64>> = None;
        for _ in 0..PLACING_TRIES {
            let path = self.path().join(ticket_name(number));
            match crate::file::place_new(&temp, &path) {
                Ok(true) => {
                    // Stamped by the rename that placed it: what every reader reads.
                    let meta = file.metadata().map_err(|cause| crate::Error::Io {
                        op: "reading the placed queue ticket",
                        path: path.clone(),
                        cause,
                    })?;
                    return Ok(Ticket {
                        file,
                        path,
                        number,
                        placed: placed(&meta),
                    });
                }
                Ok(false) => {}
                Err(e) => {
                    let _ = fs::remove_file(&temp);
                    return Err(e);
                }
            }
            // Taken: by a request placed meanwhile, or by a file (live or not).
            let names = taken.get_or_insert_with(|| {
                self.names()
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|n| ticket_of(n))
                    .collect()
            });
            names.insert(number);
            number = (number + 1..=MAX_TICKET)
                .find(|n| !names.contains(n))
                .unwrap_or(MAX_TICKET + 1);
            if number > MAX_TICKET {
                break;
            }
        }
        let _ = fs::remove_file(&temp);
        Err(self.error(format!(
            "no free queue number after {PLACING_TRIES} tries: list it and remove the \
             files named wait-*.json that no request holds"
        )))
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
    /// [`FALLBACK_RECHECK_EVERY`] with inotify, 2 ms without).
    pub(crate) fn wait(&self, limit: Duration) {
        let Some(inotify) = &self.fd else {
            std::thread::sleep(limit.min(Duration::from_millis(2)));
            return;
        };
        let limit = limit.min(FALLBACK_RECHECK_EVERY);
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
    fn a_waiter_reads_as_one_line_of_torchtools_queue() {
        let waiter = Waiter {
            position: 2,
            ticket: 9,
            who: Requester {
                since_unix: 951_782_400,
                ..Holder::example().who
            },
            priority: None,
            why: None,
            held: None,
            placed: (0, 0),
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
        assert_eq!(queue[0].who.reserved, Some(Bytes::gib(3)));
        assert_eq!(queue[0].who.pid, std::process::id());
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
        // Numbering goes on after the largest live ticket; a name taken by anything
        // else is skipped, never replaced.
        fs::create_dir(dir.path().join(ticket_name(1))).unwrap();
        let t = dir.enqueue(&Holder::current(), &waiter.wants).unwrap();
        assert_eq!(t.number(), 2);
        assert!(dir.path().join(ticket_name(1)).is_dir(), "left in place");
        let u = dir.enqueue(&Holder::current(), &waiter.wants).unwrap();
        assert_eq!(u.number(), 3);
    }
}
