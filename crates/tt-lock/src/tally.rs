//! Each user's recent use for the fair share, folded as the usage logs are read, so
//! that a decision costs the same whatever the history and whatever one user wrote
//! into a log of their own.
//!
//! A process keeps, per lock directory, each log's place and what its records add up
//! to: a reservation that ended is folded into its user's decayed sum at once and
//! forgotten; one still open is kept (at most [`MAX_OPEN`] per log: past that, the
//! oldest is folded in as ended when the log's next reservation started, charged to the
//! log's owner, who wrote them), with the last time its holder said it was alive (a
//! holder that died holding its GPU ended at the latest [`crate::usage::ALIVE_EVERY`]
//! after that: only its own log says when). A decision then reads what was appended
//! since, and sums a few numbers per user and per open reservation.
//!
//! The sums are kept as `w * exp(k * (t - origin))` integrals (`k = ln 2 / half_life`)
//! and decayed to `now` when read: exactly the integral `decayed_use` computes from the
//! records, without them. `origin` moves forward before the exponent could overflow.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::usage::{lost_end, read_more, Sink, SummaryLine, Tailed, Usage, SUMMARY_EVERY};
use crate::Ignored;

/// Open reservations kept per log; an honest user has as many as they hold now plus
/// those of holders that died holding a GPU.
pub(crate) const MAX_OPEN: usize = 4096;

/// `k * (t - origin)` past which the sums are moved to a later origin.
const REBASE_AT: f64 = 200.0;

/// One reservation still open.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Open {
    user: String,
    start: f64,
    weight: f64,
    /// The last time its holder said it was alive (its start until then).
    alive: f64,
    /// A decision already found its holder dead (its end, if it is ever written, came
    /// before that decision's reading).
    seen_dead: bool,
}

/// The reservations of one log still open as it is read, `T` each, at most
/// [`MAX_OPEN`]: past that the oldest is taken to have ended when the log's latest
/// reservation started (charged to the log's owner, who wrote them all). The fair
/// share's tally and `usage`'s sums keep them alike.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Opens<T> {
    /// Open reservations by id.
    #[serde(rename = "open")]
    pub(crate) by_id: HashMap<String, T>,
    /// Their ids in the order read (and ids of some that ended since, which leave its
    /// front as they come to it).
    pub(crate) order: VecDeque<String>,
    /// The latest start read.
    pub(crate) latest: f64,
}

impl<T> Default for Opens<T> {
    fn default() -> Opens<T> {
        Opens {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            latest: 0.0,
        }
    }
}

impl<T> Opens<T> {
    /// Keeps `value` open under `id`, started at `start`: returns the reservations that
    /// end as it starts, each with when (an earlier one under the same id, when this
    /// began; the oldest past [`MAX_OPEN`], at the latest start read).
    pub(crate) fn start(&mut self, id: String, start: f64, value: T) -> Vec<(T, f64)> {
        self.latest = self.latest.max(start);
        // Ids of reservations ended since they were read leave the front of the order
        // as they come to it (a log reads start, end, start, end...): the order holds
        // about the open ones, not every id ever read.
        while self
            .order
            .front()
            .is_some_and(|id| !self.by_id.contains_key(id))
        {
            self.order.pop_front();
        }
        let mut ended = Vec::new();
        match self.by_id.insert(id.clone(), value) {
            // The same id again: the first is taken to have ended when this began.
            Some(earlier) => ended.push((earlier, start)),
            None => self.order.push_back(id),
        }
        while self.by_id.len() > MAX_OPEN {
            let Some(id) = self.order.pop_front() else {
                break;
            };
            if let Some(oldest) = self.by_id.remove(&id) {
                ended.push((oldest, self.latest));
            }
        }
        ended
    }

    /// Makes the order name each open reservation once (as reading keeps it): after
    /// some were removed out of order, or as a summary its owner wrote says it.
    pub(crate) fn order_each_once(&mut self) {
        let mut seen = HashSet::new();
        let by_id = &self.by_id;
        self.order
            .retain(|id| by_id.contains_key(id) && seen.insert(id.clone()));
        let missing: Vec<String> = by_id
            .keys()
            .filter(|id| !seen.contains(*id))
            .cloned()
            .collect();
        self.order.extend(missing);
    }
}

/// One log as folded so far (see the module's documentation).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Folded {
    k: f64,
    origin: f64,
    /// Ended reservations: per user, the sum of `w * (g(end) - g(start)) / k`, where
    /// `g(t) = exp(k * (t - origin))`.
    closed: HashMap<String, f64>,
    /// Open reservations (written flat, as `open`, `order` and `latest`).
    #[serde(flatten)]
    open: Opens<Open>,
}

/// The weight of a reservation's seconds: a sharer's part of its GPU, else 1.
fn weight(r: &Usage) -> f64 {
    match (r.share_of, r.bytes) {
        (Some(capacity), Some(bytes)) if capacity > 0 => (bytes as f64 / capacity as f64).min(1.0),
        _ => 1.0,
    }
}

impl Folded {
    fn g(&self, t: f64) -> f64 {
        (self.k * (t - self.origin)).exp()
    }

    fn fold(&mut self, open: Open, end: f64) {
        let end = end.max(open.start);
        let add = open.weight * (self.g(end) - self.g(open.start)) / self.k;
        *self.closed.entry(open.user).or_default() += add;
    }

    /// Moves the sums to `origin`.
    fn rebase(&mut self, origin: f64) {
        let factor = (-self.k * (origin - self.origin)).exp();
        for v in self.closed.values_mut() {
            *v *= factor;
        }
        self.origin = origin;
    }
}

impl Sink for Folded {
    fn start(&mut self, r: Usage) {
        let start = r.since_unix;
        let open = Open {
            weight: weight(&r),
            user: r.user,
            start,
            alive: start,
            seen_dead: false,
        };
        for (ended, at) in self.open.start(r.id, start, open) {
            self.fold(ended, at);
        }
    }

    fn end(&mut self, id: &str, time: f64, _status: Option<i32>, _lost: bool) {
        if let Some(open) = self.open.by_id.remove(id) {
            self.fold(open, time);
        }
    }

    fn alive(&mut self, id: &str, time: f64) {
        if let Some(open) = self.open.by_id.get_mut(id) {
            open.alive = open.alive.max(time);
        }
    }

    // What a log holds that is not believed or cannot be read counts for nothing here;
    // `usage` and `policy` report it.
    fn skipped(&mut self, _why: String) {}

    fn ignored(&mut self, _why: Ignored) {}

    fn reset(&mut self) {
        *self = Folded {
            k: self.k,
            origin: self.origin,
            ..Folded::default()
        };
    }

    fn summary(&mut self, line: SummaryLine, believed: &dyn Fn(&str) -> bool) -> bool {
        let half_life = line.half_life;
        let Ok(mut summary) = serde_json::from_value::<Folded>(line.state) else {
            return false;
        };
        let finite = |v: f64| v.is_finite() && v >= 0.0;
        let sane = summary.k == self.k
            && self.k == std::f64::consts::LN_2 / half_life.max(1e-9)
            && finite(summary.origin)
            && finite(summary.open.latest)
            && summary.open.by_id.len() <= MAX_OPEN
            && summary
                .closed
                .iter()
                .all(|(user, v)| finite(*v) && believed(user))
            && summary.open.by_id.values().all(|o| {
                believed(&o.user)
                    && [o.start, o.alive].into_iter().all(finite)
                    && (0.0..=1.0).contains(&o.weight)
            });
        if !sane {
            return false;
        }
        summary.rebase(self.origin);
        if !summary.closed.values().all(|v| v.is_finite()) {
            return false;
        }
        summary.open.order_each_once();
        *self = summary;
        true
    }
}

/// A lock directory's logs as folded so far by this process (and, through the reading
/// user's cache, by their earlier processes).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct DirTally {
    half_life: f64,
    origin: f64,
    logs: HashMap<PathBuf, Tailed<Folded>>,
}

/// Every lock directory's tally in this process (read on from where it stopped at each
/// decision: logs only grow).
static TALLY: std::sync::LazyLock<std::sync::Mutex<HashMap<PathBuf, DirTally>>> =
    std::sync::LazyLock::new(Default::default);

/// Each user's recent use at `now`, in GPU-seconds decayed with `half_life` seconds,
/// from the logs of `dir` named `logs` (path and uid, at most [`crate::usage::MAX_LOGS`] per uid), read
/// on from where this process stopped; `live` gives the usage ids (with their users) of
/// live holder and sharer records, read once the logs are: an open reservation not
/// among them belonged to a holder that died holding its GPU, and ended at the latest
/// as [`crate::usage::lost_end`] says (from its own log alone), else now.
///
/// A process's first decision starts from the tally its user's last process kept in
/// `cache` (this user's file, see [`cache_file`]), when there is one for this directory
/// and half-life, and reads on from there; a decision that read much saves it again.
///
/// Every log is read from its last summary among its last
/// [`crate::usage::SUMMARY_SEARCH`] bytes, as a reader new to it reads it; a log with
/// none there is not read ([`RecentUse::unread`]), so what one user writes into their
/// own log costs every reader at most that much. With `summarize`, this user's own logs
/// get a summary every [`SUMMARY_EVERY`] bytes, and one that others do not read is read
/// whole (at this user's cost) and summarized.
pub(crate) fn recent_use(
    dir: &Path,
    logs: &[crate::usage::LogFile],
    half_life: f64,
    live: impl FnOnce() -> crate::Result<HashSet<(String, String)>>,
    now: f64,
    cache: Option<&Path>,
    summarize: bool,
) -> crate::Result<RecentUse> {
    let mut all = TALLY.lock().unwrap_or_else(|e| e.into_inner());
    let tally = all.entry(dir.to_owned()).or_insert_with(|| {
        cache
            .and_then(|c| load(c, dir, half_life, &this_machine()))
            .unwrap_or_default()
    });
    let k = std::f64::consts::LN_2 / half_life.max(1e-9);
    if tally.half_life != half_life || tally.logs.is_empty() {
        // A new policy (or the first read): folded anew.
        *tally = DirTally {
            half_life,
            origin: now,
            logs: HashMap::new(),
        };
    }
    if k * (now - tally.origin) > REBASE_AT {
        tally.origin = now;
        for log in tally.logs.values_mut() {
            log.sink.rebase(now);
        }
    }
    let present: HashSet<&PathBuf> = logs.iter().map(|(p, _)| p).collect();
    tally.logs.retain(|path, _| present.contains(path));
    let read_before: u64 = tally.logs.values().map(Tailed::offset).sum();
    tally.read(logs)?;
    // After the reading: a start read has its live record already (it is written
    // first), so only a holder that let go or died since is taken for dead.
    let live = live()?;
    settle(tally, &live, now);
    if summarize {
        tally.summarize_own(logs)?;
    }
    let read_now: u64 = tally.logs.values().map(Tailed::offset).sum();
    if let Some(cache) = cache.filter(|_| read_now.abs_diff(read_before) >= SAVE_AFTER) {
        save(cache, dir, tally);
    }
    Ok(tally.uses(logs, &live, now))
}

impl DirTally {
    /// A log not read yet, read from its last summary ([`Tailed::from_last_summary`]).
    fn fresh(&self, path: &Path) -> Tailed<Folded> {
        Tailed::from_last_summary(
            path,
            Folded {
                k: std::f64::consts::LN_2 / self.half_life.max(1e-9),
                origin: self.origin,
                ..Folded::default()
            },
        )
    }

    /// Reads on in each of `logs`: from its last summary, as a reader new to it reads
    /// it (what reading it all would hold there: its owner's own word, as every line of
    /// it is), and on from there while that summary is still among its last bytes.
    fn read(&mut self, logs: &[crate::usage::LogFile]) -> crate::Result<()> {
        for (path, uid) in logs {
            let reads_on = self
                .logs
                .get(path)
                .zip(file_and_len(path))
                .is_some_and(|(log, (file, len))| log.reads_on(file, len));
            if !reads_on {
                let log = self.fresh(path);
                self.logs.insert(path.clone(), log);
            }
            if let Some(log) = self.logs.get_mut(path) {
                read_more(path, *uid, log, true)?;
            }
        }
        Ok(())
    }

    /// Summarizes this user's own `logs` for readers new to them every
    /// [`SUMMARY_EVERY`] bytes (a summary is read back as its writer holds it). One that
    /// others do not read is read whole here, at its owner's cost, and summarized:
    /// every reader then starts at that summary (this one too, at once).
    fn summarize_own(&mut self, logs: &[crate::usage::LogFile]) -> crate::Result<()> {
        let me = crate::owner::euid();
        for (path, uid) in logs.iter().filter(|(_, uid)| *uid == me) {
            let Some(log) = self.logs.get(path) else {
                continue;
            };
            if log.unread() {
                if summarize_whole(path, *uid, log.sink.k, self.origin, self.half_life)? {
                    let mut log = self.fresh(path);
                    read_more(path, *uid, &mut log, true)?;
                    self.logs.insert(path.clone(), log);
                }
            } else if log.since_summary() >= SUMMARY_EVERY {
                append_folded(path, log.offset(), self.half_life, &log.sink);
            }
        }
        Ok(())
    }

    /// Each user's recent use at `now` from the logs read, `live` naming the live
    /// holders' usage ids; and the owners of `logs` not read.
    fn uses(
        &self,
        logs: &[crate::usage::LogFile],
        live: &HashSet<(String, String)>,
        now: f64,
    ) -> RecentUse {
        let k = std::f64::consts::LN_2 / self.half_life.max(1e-9);
        let decay = (-k * (now - self.origin)).exp();
        let mut uses: HashMap<String, f64> = HashMap::new();
        let mut unread: HashMap<String, String> = HashMap::new();
        for (path, uid) in logs {
            if let Some(log) = self.logs.get(path).filter(|log| log.unread()) {
                unread
                    .entry(crate::owner::name_of_uid(*uid))
                    .or_insert_with(|| log.why_unread(path));
            }
        }
        for log in self.logs.values().filter(|log| !log.unread()) {
            for (user, v) in &log.sink.closed {
                *uses.entry(user.clone()).or_default() += v * decay;
            }
            for (id, open) in &log.sink.open.by_id {
                // Live (settle folded the dead ones whose end is known): until now.
                let end = if live.contains(&(open.user.clone(), id.clone())) {
                    now
                } else {
                    lost_end(open.start, Some(open.alive), now)
                }
                .clamp(open.start.min(now), now);
                *uses.entry(open.user.clone()).or_default() +=
                    open.weight * decayed_span(k, open.start.min(end), end, now);
            }
        }
        RecentUse { uses, unread }
    }
}

/// Each user's recent use as [`recent_use`] reads it.
#[derive(Debug, Default)]
pub(crate) struct RecentUse {
    /// GPU-seconds per user, decayed, from the logs read.
    pub(crate) uses: HashMap<String, f64>,
    /// The users with a log not read ([`Tailed::unread`]), and why: each stands as
    /// the heaviest user until their next request summarizes it.
    pub(crate) unread: HashMap<String, String>,
}

/// The file (device and inode) and length of the log at `path`, without following a
/// link; `None` when there is nothing there.
fn file_and_len(path: &Path) -> Option<((u64, u64), u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).ok()?;
    Some(((meta.dev(), meta.ino()), meta.len()))
}

/// Reads this user's own log at `path` (of `uid`) whole and appends its summary,
/// decayed with `half_life` seconds (`k`, sums from `origin`): whether it was written
/// (not when the reading stopped, or the summary is too long for a line).
fn summarize_whole(
    path: &Path,
    uid: u32,
    k: f64,
    origin: f64,
    half_life: f64,
) -> crate::Result<bool> {
    let mut whole = Tailed::new(Folded {
        k,
        origin,
        ..Folded::default()
    });
    read_more(path, uid, &mut whole, true)?;
    Ok(!whole.stopped() && append_folded(path, whole.offset(), half_life, &whole.sink))
}

/// Appends to this user's log at `path` the fair share's summary `folded` of its first
/// `upto` bytes, decayed with `half_life` seconds: whether it was written.
fn append_folded(path: &Path, upto: u64, half_life: f64, folded: &Folded) -> bool {
    serde_json::to_value(folded)
        .is_ok_and(|state| crate::usage::append_summary(path, upto, half_life, state, None))
}

/// The GPU-seconds from `start` to `end` decayed to `now` with `k = ln 2 / half_life`:
/// the integral of `2^(-(now - t) / half_life)`.
fn decayed_span(k: f64, start: f64, end: f64, now: f64) -> f64 {
    ((-k * (now - end)).exp() - (-k * (now - start)).exp()) / k
}

/// Bytes of logs read by one decision past which the tally is saved for the next
/// process.
const SAVE_AFTER: u64 = 256 << 10;

/// The largest cache read or written.
const MAX_CACHE: u64 = 64 << 20;

/// The form of the kept tally: another is not read.
const CACHE_VERSION: u32 = 3;

/// A tally as kept between processes: the machine and directory it is of, and what was
/// folded.
#[derive(Deserialize)]
struct Cached {
    version: u32,
    machine: String,
    dir: PathBuf,
    tally: DirTally,
}

/// [`Cached`] as written, borrowing.
#[derive(Serialize)]
struct CachedRef<'a> {
    version: u32,
    machine: &'a str,
    dir: &'a Path,
    tally: &'a DirTally,
}

/// This machine since its last boot, as a kept tally names it: a home shared by several
/// servers (NFS) holds one tally per server, and a reboot (which may empty `/tmp`, and
/// gives files their inode numbers anew) starts one afresh, so a log is never read on
/// from another file's place.
fn this_machine() -> String {
    format!("{} {}", tt_device::host_name(), tt_device::boot_id())
}

/// The file where this user keeps the tally of the lock directory `dir` between
/// processes: `$XDG_CACHE_HOME/torchtools/tally-<hash of host and dir>.json` (or under
/// `~/.cache`); `None` without either.
pub(crate) fn cache_file(dir: &Path) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    let base = tt_device::user_dir("XDG_CACHE_HOME", ".cache")?;
    let mut hash = std::collections::hash_map::DefaultHasher::new();
    tt_device::host_name().hash(&mut hash);
    dir.hash(&mut hash);
    Some(
        base.join("torchtools")
            .join(format!("tally-{:016x}.json", hash.finish())),
    )
}

/// The tally kept in `cache` for `dir` and `half_life` on `machine` ([`this_machine`]),
/// when it is this user's own regular file of a sane size and reads whole.
fn load(cache: &Path, dir: &Path, half_life: f64, machine: &str) -> Option<DirTally> {
    use std::os::unix::fs::MetadataExt;
    let (file, meta) = crate::file::open_to_read(cache)?;
    if meta.uid() != crate::owner::euid() || meta.len() > MAX_CACHE {
        return None;
    }
    let cached: Cached = serde_json::from_reader(std::io::BufReader::new(file)).ok()?;
    (cached.version == CACHE_VERSION
        && cached.machine == machine
        && cached.dir == dir
        && cached.tally.half_life == half_life)
        .then_some(cached.tally)
}

/// Keeps `tally` in `cache` for this user's next process (written aside and renamed,
/// in a directory of this user's own); nothing when that cannot be done.
fn save(cache: &Path, dir: &Path, tally: &DirTally) {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let Some(parent) = cache.parent() else { return };
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent);
    if !std::fs::symlink_metadata(parent)
        .is_ok_and(|m| m.is_dir() && m.uid() == crate::owner::euid())
    {
        return;
    }
    let Ok(mut text) = serde_json::to_vec(&CachedRef {
        version: CACHE_VERSION,
        machine: &this_machine(),
        dir,
        tally,
    }) else {
        return;
    };
    text.push(b'\n');
    if text.len() as u64 > MAX_CACHE {
        return;
    }
    let temp = parent.join(format!(".tally-{}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)
        .and_then(|mut f| f.write_all(&text));
    if written.is_err() || std::fs::rename(&temp, cache).is_err() {
        let _ = std::fs::remove_file(&temp);
    }
}

/// Folds in every open reservation of a holder found dead by an earlier decision too
/// (so no end of its own is still to be read) whose latest end has passed (it is
/// known), and marks the others whose holder is not live as found dead.
fn settle(tally: &mut DirTally, live: &HashSet<(String, String)>, now: f64) {
    for log in tally.logs.values_mut() {
        let sink = &mut log.sink;
        let mut ended: Vec<(String, f64)> = Vec::new();
        for (id, open) in sink.open.by_id.iter_mut() {
            if live.contains(&(open.user.clone(), id.clone())) {
                continue;
            }
            let end = lost_end(open.start, Some(open.alive), f64::INFINITY);
            if open.seen_dead && end <= now {
                ended.push((id.clone(), end));
            }
            open.seen_dead = true;
        }
        for (id, end) in ended {
            if let Some(open) = sink.open.by_id.remove(&id) {
                sink.fold(open, end);
            }
        }
        let by_id = &sink.open.by_id;
        sink.open.order.retain(|id| by_id.contains_key(id));
    }
}

/// Each user's recent use in GPU-seconds at `now`, decayed with `half_life` seconds,
/// from whole records: what the fold computes without keeping them (the tests compare the
/// two).
#[cfg(test)]
pub(crate) fn decayed_use<'r>(
    records: impl IntoIterator<Item = &'r Usage>,
    now: f64,
    half_life: f64,
) -> HashMap<String, f64> {
    let k = std::f64::consts::LN_2 / half_life.max(1e-9);
    let mut uses: HashMap<&'r str, f64> = HashMap::new();
    for r in records {
        let end = r.ended_unix.unwrap_or(now).min(now);
        let start = r.since_unix.min(end);
        if !(start.is_finite() && end.is_finite()) {
            continue;
        }
        *uses.entry(r.user.as_str()).or_default() += weight(r) * decayed_span(k, start, end, now);
    }
    uses.into_iter().map(|(u, v)| (u.to_owned(), v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// What a reader keyed `dir` (a process of its own) reads of `logs` at `now`, with
    /// `live` the live holders' usage ids; `summarize`: as a request of the logs' owner
    /// does.
    fn read_at(
        dir: &Path,
        logs: &[crate::usage::LogFile],
        half_life: f64,
        live: &HashSet<(String, String)>,
        now: f64,
        summarize: bool,
    ) -> RecentUse {
        recent_use(
            dir,
            logs,
            half_life,
            || Ok(live.clone()),
            now,
            None,
            summarize,
        )
        .unwrap()
    }

    /// Appends `lines` (JSON records) to the log at `path`.
    fn append(path: &Path, lines: &[String]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
    }

    fn start(id: &str, user: &str, gpu: &str, t: f64, share: Option<(u64, u64)>) -> String {
        let (bytes, of) = share.map_or(("null".into(), String::new()), |(b, c)| {
            (b.to_string(), format!(",\"share_of\":{c}"))
        });
        format!(
            "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{user}\",\"host\":\"h\",\"pid\":1,\
             \"gpu\":\"{gpu}\",\"bytes\":{bytes},\"time\":{t},\"command\":[]{of}}}"
        )
    }

    fn end(id: &str, t: f64) -> String {
        format!("{{\"event\":\"end\",\"id\":\"{id}\",\"time\":{t},\"status\":0}}")
    }

    fn alive(id: &str, t: f64) -> String {
        format!("{{\"event\":\"alive\",\"id\":\"{id}\",\"time\":{t}}}")
    }

    /// What a fresh reader computes from the whole records (`decayed_use`, with dead
    /// holders ended as `usage` ends them).
    fn from_records(
        path: &Path,
        uid: u32,
        live: &HashSet<(String, String)>,
        now: f64,
        half_life: f64,
    ) -> HashMap<String, f64> {
        let mut log = crate::UsageLog::default();
        let mut state = Tailed::<crate::usage::Records>::default();
        read_more(path, uid, &mut state, true).unwrap();
        let _ = &mut log;
        let mut records: Vec<Usage> = state.sink.into_records();
        crate::usage::end_lost(&mut records, live, now);
        decayed_use(&records, now, half_life)
    }

    fn close(a: &HashMap<String, f64>, b: &HashMap<String, f64>) -> bool {
        a.len() == b.len()
            && a.iter().all(|(u, v)| {
                b.get(u)
                    .is_some_and(|w| (v - w).abs() <= 1e-6 * v.abs().max(1.0))
            })
    }

    #[test]
    fn the_fold_computes_what_the_records_give_at_every_decision() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let path = tmp.path().join(format!("usage-{uid}.jsonl"));
        let now = tt_device::now_unix();
        let half_life = 3600.0;
        // Closed, a sharer's, a dead holder's (GPU taken later), a dead holder's that
        // said it was alive (its end still to come at the first decisions), a live one.
        append(
            &path,
            &[
                start("a", &me, "g0", now - 9000.0, None),
                end("a", now - 5000.0),
                start("s", &me, "g1", now - 8000.0, Some((20, 80))),
                end("s", now - 7000.0),
                start("dead", &me, "g0", now - 4000.0, None),
                start("next", &me, "g0", now - 3000.0, None),
                end("next", now - 2500.0),
                start("lost", &me, "g2", now - 2000.0, None),
                alive("lost", now - 1400.0),
                alive("lost", now - 598.5),
                start("live", &me, "g3", now - 1000.0, None),
                alive("live", now - 400.0),
            ],
        );
        let live: HashSet<(String, String)> = [(me.clone(), "live".to_owned())].into();
        let dir = tmp.path().join("one");
        let logs = [(path.clone(), uid)];
        for round in 0..3 {
            let t = now + round as f64;
            let folded = read_at(&dir, &logs, half_life, &live, t, true).uses;
            let fresh = from_records(&path, uid, &live, t, half_life);
            assert!(
                close(&folded, &fresh),
                "round {round}: {folded:?} != {fresh:?}"
            );
            // Appended between decisions: read on, the same as a fresh reading.
            append(
                &path,
                &[
                    start(
                        &format!("r{round}"),
                        &me,
                        "g2",
                        t - 500.0 + round as f64,
                        None,
                    ),
                    end(&format!("r{round}"), t),
                ],
            );
        }
        // The dead holders' records were folded once their ends had passed.
        let all = TALLY.lock().unwrap();
        let log = &all[&dir].logs[&path].sink;
        assert!(
            !log.open.by_id.contains_key("dead"),
            "{:?}",
            log.open.by_id.keys()
        );
        assert!(
            !log.open.by_id.contains_key("lost"),
            "{:?}",
            log.open.by_id.keys()
        );
        assert!(
            log.open.by_id.contains_key("live"),
            "{:?}",
            log.open.by_id.keys()
        );
    }

    /// A log its owner summarized as they reserved: a reader new to it reads from its
    /// last summary (a few hundred KiB of a log of any length) and computes what
    /// reading every record gives, as does a reader that read it all along; a summary
    /// naming another user, or not starting where it says, is not taken.
    #[test]
    fn a_reader_new_to_a_log_starts_at_its_last_summary_and_computes_what_the_records_give() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let path = tmp.path().join(format!("usage-{uid}.jsonl"));
        let now = tt_device::now_unix();
        let half_life = 3600.0 * 24.0;
        let logs = [(path.clone(), uid)];
        let live: HashSet<(String, String)> = [(me.clone(), "live".to_owned())].into();
        // Open across every summary: one live, one whose holder died.
        append(
            &path,
            &[
                start("live", &me, "g3", now - 90_000.0, None),
                start("dead", &me, "g2", now - 89_000.0, None),
                alive("dead", now - 88_000.0),
            ],
        );
        let along = tmp.path().join("along");
        for batch in 0..30 {
            let lines: Vec<String> = (0..100)
                .flat_map(|i| {
                    let n = batch * 100 + i;
                    let t = now - 80_000.0 + n as f64 * 25.0;
                    [
                        start(&format!("r{n}"), &me, "g0", t, Some((1, 2 + n % 3))),
                        end(&format!("r{n}"), t + 20.0),
                    ]
                })
                .collect();
            append(&path, &lines);
            // What each request does under a fair-share policy, in processes of its
            // own (each reads on from its last summary).
            let writer = tmp.path().join(format!("writer-{batch}"));
            read_at(&writer, &logs, half_life, &live, now, true);
            // A long-running reader reads on between them.
            read_at(&along, &logs, half_life, &live, now, true);
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let summaries = text.matches("\"event\":\"summary\"").count();
        assert!(
            summaries >= 3,
            "{summaries} summaries in {} bytes",
            text.len()
        );

        let len = text.len() as u64;
        let k = std::f64::consts::LN_2 / half_life;
        let log = Tailed::from_last_summary(
            &path,
            Folded {
                k,
                origin: now,
                ..Folded::default()
            },
        );
        assert!(
            log.offset() > 0 && len - log.offset() <= 2 * SUMMARY_EVERY,
            "a new reader starts at byte {} of {len}",
            log.offset()
        );
        let fresh_dir = tmp.path().join("fresh");
        let fresh = read_at(&fresh_dir, &logs, half_life, &live, now, true).uses;
        let all_along = read_at(&along, &logs, half_life, &live, now, true).uses;
        let records = from_records(&path, uid, &live, now, half_life);
        assert!(close(&fresh, &records), "{fresh:?} != {records:?}");
        assert!(close(&all_along, &fresh), "{all_along:?} != {fresh:?}");
        {
            let all = TALLY.lock().unwrap();
            let open = &all[&fresh_dir].logs[&path].sink.open.by_id;
            // The live one carried across every summary (the dead one folded at its
            // latest end once a writer found it dead twice).
            assert!(open.contains_key("live"), "{:?}", open.keys());
        }

        // Summaries not taken: one naming another user, one not where it says.
        let forged = |upto: u64, user: &str| {
            format!(
                "{{\"event\":\"summary\",\"upto\":{upto},\"half_life\":{half_life},\"state\":\
                 {{\"k\":{k},\"origin\":{now},\"closed\":{{\"{user}\":1e9}},\"open\":{{}},\
                 \"order\":[],\"latest\":{now}}}}}"
            )
        };
        append(&path, &[forged(len, "someone-else")]);
        let at = std::fs::metadata(&path).unwrap().len();
        append(&path, &[forged(at + 1, &me)]);
        for reader in ["again", "along"] {
            let dir = tmp.path().join(reader);
            let read = read_at(&dir, &logs, half_life, &live, now, true).uses;
            assert!(close(&read, &records), "{reader}: {read:?} != {records:?}");
        }
        // One that is where it says, in the owner's name, counts for its owner alone:
        // for every reader alike.
        let at = std::fs::metadata(&path).unwrap().len();
        append(&path, &[forged(at, &me)]);
        let along_read = read_at(&along, &logs, half_life, &live, now, true).uses;
        let new_read = recent_use(
            &tmp.path().join("new"),
            &logs,
            half_life,
            || Ok(live.clone()),
            now,
            None,
            true,
        )
        .unwrap()
        .uses;
        assert!(
            close(&along_read, &new_read),
            "{along_read:?} != {new_read:?}"
        );
        assert!(along_read[&me] > records[&me] * 10.0, "{along_read:?}");
        assert_eq!(along_read.len(), 1, "{along_read:?}");
    }

    #[test]
    fn a_process_reads_on_from_the_tally_its_users_last_process_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let path = tmp.path().join(format!("usage-{uid}.jsonl"));
        let now = tt_device::now_unix();
        let lines: Vec<String> = (0..4000)
            .rev()
            .flat_map(|i| {
                // The first record written ends a minute ago: it counts almost whole.
                let t = now - 40_065.0 + i as f64 * 10.0;
                [
                    start(&format!("r{i}"), &me, "g0", t, None),
                    end(&format!("r{i}"), t + 5.0),
                ]
            })
            .collect();
        append(&path, &lines);
        let dir = tmp.path().join("kept");
        let cache = tmp.path().join("cache/tally.json");
        let logs = [(path.clone(), uid)];
        let live = HashSet::new();
        let read = std::fs::metadata(&path).unwrap().len();
        let first = recent_use(
            &dir,
            &logs,
            3600.0,
            || Ok(live.clone()),
            now,
            Some(&cache),
            true,
        )
        .unwrap()
        .uses;
        assert!(
            cache.exists(),
            "saved after reading {} bytes",
            std::fs::metadata(&path).unwrap().len()
        );
        // A new process: nothing in memory; it starts from the kept tally, at the log's end.
        TALLY.lock().unwrap().remove(&dir);
        let kept = load(&cache, &dir, 3600.0, &this_machine()).unwrap();
        // (Its own log: the decision summarized it after reading it.)
        assert_eq!(kept.logs[&path].offset(), read);
        assert!(
            load(&cache, &dir, 7200.0, &this_machine()).is_none(),
            "another half-life: folded anew"
        );
        // Kept on another server sharing this home, or before a reboot: not read here.
        for machine in [
            "other-server",
            &format!("{} an-earlier-boot", tt_device::host_name()),
        ] {
            assert!(load(&cache, &dir, 3600.0, machine).is_none(), "{machine}");
        }
        append(
            &path,
            &[start("late", &me, "g0", now, None), end("late", now + 1.0)],
        );
        let later = now + 2.0;
        let fresh = from_records(&path, uid, &live, later, 3600.0);
        // The first record blanked in place: only a reader that starts over misses it.
        let text = std::fs::read_to_string(&path).unwrap();
        let first_line = text.lines().next().unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all(" ".repeat(first_line).as_bytes())
            .unwrap();
        let second = recent_use(
            &dir,
            &logs,
            3600.0,
            || Ok(live.clone()),
            later,
            Some(&cache),
            true,
        )
        .unwrap()
        .uses;
        assert!(close(&second, &fresh), "{second:?} != {fresh:?}");
        assert!(second[&me] > first[&me] * 0.99, "{first:?} {second:?}");
    }

    #[test]
    fn reading_a_long_history_keeps_no_ended_reservations_ids() {
        let mut folded = Folded {
            k: std::f64::consts::LN_2 / 3600.0,
            origin: 1000.0,
            ..Folded::default()
        };
        for i in 0..10_000 {
            let id = format!("r{i}");
            folded.start(Usage {
                id: id.clone(),
                user: "ada".into(),
                host: "h".into(),
                pid: 1,
                gpu: "g0".into(),
                bytes: None,
                command: Vec::new(),
                share_of: None,
                since_unix: f64::from(i),
                ended_unix: None,
                status: None,
                lost: false,
                alive: None,
            });
            folded.end(&id, f64::from(i) + 0.5, Some(0), false);
        }
        assert!(folded.open.by_id.is_empty());
        assert!(folded.open.order.len() <= 1, "{}", folded.open.order.len());
        assert!(folded.closed["ada"] > 0.0);
    }

    #[test]
    fn one_users_junk_keeps_a_bounded_fold_and_is_read_by_nobody() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let junk = tmp.path().join(format!("usage-{uid}.jsonl"));
        let now = tt_device::now_unix();
        let lines: Vec<String> = (0..3 * MAX_OPEN)
            .map(|i| {
                start(
                    &format!("j{i}"),
                    &me,
                    "g0",
                    now - 10_000.0 + i as f64 * 0.1,
                    None,
                )
            })
            .collect();
        append(&junk, &lines);
        assert!(std::fs::metadata(&junk).unwrap().len() > crate::usage::SUMMARY_SEARCH);
        let logs = [(junk.clone(), uid)];
        let live = HashSet::new();
        // Its owner's request reads it whole to summarize it: the summary of 4096 open
        // reservations does not fit a line, so it stays unread, by its owner's
        // decisions too, and they stand as the heaviest user.
        for (reader, summarize) in [("other", false), ("owner", true)] {
            let dir = tmp.path().join(reader);
            let read = recent_use(
                &dir,
                &logs,
                3600.0,
                || Ok(live.clone()),
                now,
                None,
                summarize,
            )
            .unwrap();
            assert!(read.uses.is_empty(), "{reader}: {read:?}");
            assert!(
                read.unread[&me].contains("not read: more than 1 MiB of it past its last summary"),
                "{reader}: {read:?}"
            );
        }
        assert!(!std::fs::read_to_string(&junk).unwrap().contains("summary"));
        // Read whole, as its owner's request reads it, the fold stays bounded.
        let mut whole = Tailed::new(Folded {
            k: std::f64::consts::LN_2 / 3600.0,
            origin: now,
            ..Folded::default()
        });
        read_more(&junk, uid, &mut whole, true).unwrap();
        assert!(
            whole.sink.open.by_id.len() <= MAX_OPEN,
            "{}",
            whole.sink.open.by_id.len()
        );
        assert!(
            whole.sink.open.order.len() <= MAX_OPEN,
            "{}",
            whole.sink.open.order.len()
        );
        assert!(whole.sink.closed[&me] > 0.0 && whole.sink.closed[&me].is_finite());
    }

    #[test]
    fn a_log_past_its_bound_is_unread_alike_by_every_reader_until_its_owner_summarizes_it() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let path = tmp.path().join(format!("usage-{uid}.jsonl"));
        let now = tt_device::now_unix();
        let half_life = 3600.0;
        let logs = [(path.clone(), uid)];
        let live = HashSet::new();
        let reservations = |from: usize, n: usize| -> Vec<String> {
            (from..from + n)
                .flat_map(|i| {
                    let t = now - 50_000.0 + i as f64;
                    [
                        start(&format!("r{i}"), &me, "g0", t, None),
                        end(&format!("r{i}"), t + 0.5),
                    ]
                })
                .collect()
        };
        let len = || std::fs::metadata(&path).unwrap().len();
        let along = tmp.path().join("along");
        let mut fresh_readers = 0;
        // A reader that read along and one new to the log, never writing to it.
        let mut both = |expect_unread: bool, step: &str| {
            fresh_readers += 1;
            let fresh = tmp.path().join(format!("fresh-{fresh_readers}"));
            let a = read_at(&along, &logs, half_life, &live, now, false);
            let f = read_at(&fresh, &logs, half_life, &live, now, false);
            assert!(close(&a.uses, &f.uses), "{step}: {a:?} != {f:?}");
            assert_eq!(
                a.unread.keys().collect::<Vec<_>>(),
                f.unread.keys().collect::<Vec<_>>(),
                "{step}"
            );
            assert_eq!(a.unread.contains_key(&me), expect_unread, "{step}: {a:?}");
            if !expect_unread {
                let records = from_records(&path, uid, &live, now, half_life);
                assert!(close(&a.uses, &records), "{step}: {a:?} != {records:?}");
            }
        };
        // Under the bound, without a summary: read from the start.
        append(&path, &reservations(0, 2000));
        assert!(len() < crate::usage::SUMMARY_SEARCH);
        both(false, "a small log");
        // Past it by its owner's writing, with no summary: read by nobody.
        append(&path, &reservations(2000, 6000));
        assert!(len() > crate::usage::SUMMARY_SEARCH);
        both(true, "past the bound");
        // Its owner's next request reads it whole and summarizes it: read again.
        let owner = tmp.path().join("owner");
        read_at(&owner, &logs, half_life, &live, now, true);
        assert_eq!(
            std::fs::read_to_string(&path)
                .unwrap()
                .matches("\"summary\"")
                .count(),
            1
        );
        both(false, "summarized");
        // Exactly the bound past that summary: still read (the byte before the search
        // says a line begins there); one byte more: read by nobody.
        let summary_at = {
            let text = std::fs::read(&path).unwrap();
            memchr::memmem::rfind(&text, b"{\"event\":\"summary\"").unwrap() as u64
        };
        while len() + 400 < summary_at + crate::usage::SUMMARY_SEARCH {
            append(&path, &reservations(9000 + len() as usize, 1));
        }
        let pad = (summary_at + crate::usage::SUMMARY_SEARCH - len()) as usize;
        // A start line of exactly `pad` bytes with its newline, padded in its command.
        let bare = start("pad", &me, "g1", now - 100.0, None);
        let fill = pad - bare.len() - 1 - 2;
        let line = bare.replace(
            "\"command\":[]",
            &format!("\"command\":[\"{}\"]", "x".repeat(fill)),
        );
        append(&path, &[line]);
        assert_eq!(len(), summary_at + crate::usage::SUMMARY_SEARCH);
        both(false, "exactly the bound past its summary");
        append(&path, &[String::new()]);
        both(true, "a byte past the bound");
        // A line too long to read, under the bound: its reading stops, alike.
        read_at(&owner, &logs, half_life, &live, now, true);
        both(false, "summarized again");
        append(&path, &["x".repeat(70_000)]);
        both(true, "an over-long line");
    }
}
