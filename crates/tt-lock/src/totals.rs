//! What the usage logs add up to per user and per GPU, read as a stream: `usage`,
//! `metrics` and the page's numbers, in memory bounded by the reservations open at once
//! (at most [`crate::tally::MAX_OPEN`] per log) whatever the history and whatever one
//! user wrote into their own log. [`LockDir::usage`] keeps every record instead.
//!
//! A log's owner summarizes its totals every [`SUMMARY_EVERY`] bytes as
//! they write it ([`summarize_own_totals`]): what ended before, per user and per GPU;
//! what is still open; when it was written; where the previous such summary is. A
//! reader new to the log starts at the last of these that was written before every
//! window it adds up begins (all time: the last one), walking back from the last one
//! among the log's last [`SUMMARY_SEARCH`] bytes; so its cost is what the log holds
//! from there on, not the whole history. A log with more than that past its last
//! summary of totals is read by nobody (reported as not read, [`Ignored`]), until its
//! owner's next record summarizes it whole, at their cost.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::tally::{Opens, MAX_OPEN};
use crate::usage::{
    lost_end, read_more, Sink, SummaryLine, Tailed, Usage, SUMMARY_EVERY, SUMMARY_SEARCH,
};
use crate::{Ignored, LockDir, Result};

/// One user's (or one GPU's) use from some time on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageTotal {
    /// Reservations counted: those that ended after the window began, or still run.
    pub reservations: usize,
    /// Of which still running.
    pub running: usize,
    /// Of which their holder died holding the GPU.
    pub lost: usize,
    /// GPU-seconds held in the window, one GPU for one second being one.
    pub gpu_seconds: f64,
    /// Reserved bytes held in the window, in byte-seconds.
    pub reserved_byte_seconds: f64,
}

/// Every user's and every GPU's use from `from_unix` on.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct UsageTotals {
    /// Where the window begins (seconds since the epoch; `f64::MIN` for all time).
    pub from_unix: f64,
    /// Per user.
    pub by_user: BTreeMap<String, UsageTotal>,
    /// Per GPU, as the records name it (`GPU-<uuid>`, or `index N`).
    pub by_gpu: BTreeMap<String, UsageTotal>,
}

impl UsageTotals {
    /// No use yet, from `from_unix` on.
    pub fn from(from_unix: f64) -> UsageTotals {
        UsageTotals {
            from_unix,
            ..UsageTotals::default()
        }
    }

    /// Counts the reservation `r` (its end as read; none while it runs, until `now`),
    /// when it ended after the window began: its time from the window's start.
    pub fn add(&mut self, r: &Usage, now: f64) {
        if r.ended_unix.is_some_and(|end| end <= self.from_unix) {
            return;
        }
        let start = r.since_unix.max(self.from_unix);
        let seconds = (r.ended_unix.unwrap_or(now) - start).max(0.0);
        for total in [
            self.by_user.entry(r.user.clone()).or_default(),
            self.by_gpu.entry(r.gpu.clone()).or_default(),
        ] {
            total.reservations += 1;
            total.running += usize::from(r.ended_unix.is_none());
            total.lost += usize::from(r.lost);
            total.gpu_seconds += seconds;
            total.reserved_byte_seconds += seconds * r.bytes.unwrap_or(0) as f64;
        }
    }
}

/// What [`LockDir::usage_totals`] read.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct UsageSummed {
    /// One per window asked for, in that order.
    pub windows: Vec<UsageTotals>,
    /// Lines that could not be read (with their file and line numbers), skipped.
    pub skipped: Vec<String>,
    /// Logs and records not believed, as [`crate::UsageLog::ignored`].
    pub ignored: Vec<Ignored>,
}

/// One log summed as it is read: its open reservations kept (at most
/// [`crate::tally::MAX_OPEN`]: past that the oldest is counted as ended when the log's
/// next reservation started, as the fair share's tally counts it), each ended one
/// added to every window at once and forgotten.
#[derive(Debug, Default)]
struct Summing {
    now: f64,
    open: Opens<Usage>,
    windows: Vec<UsageTotals>,
    skipped: Vec<String>,
    ignored: Vec<Ignored>,
    /// For a [`UsageWatch`]: how long ended reservations are kept (seconds before
    /// `now`), and those kept, at most [`MAX_RECENT`].
    keep: Option<f64>,
    recent: VecDeque<Usage>,
    /// A summary of totals taken must have been written no later than this: the
    /// earliest window's start but all time's, or the start of `keep`.
    earliest: f64,
    /// Where the last summary of totals read begins (taken or not).
    last_summary: Option<u64>,
    /// The latest end counted.
    latest_end: f64,
    /// Why the log is not read, when it is not ([`fresh`]).
    unread: Option<String>,
    /// The summary it started at ([`begin`]); `None` from the first line.
    started: Option<u64>,
}

/// Ended reservations a [`UsageWatch`] keeps per log; past that the oldest kept are
/// forgotten (only a log's own writer can end so many within the watch's window, and
/// then only their own totals of it are short).
const MAX_RECENT: usize = 16_384;

impl Summing {
    /// Summing `windows` (each from its start; `f64::MIN` for all time) at `now`,
    /// keeping the reservations that ended in the last `keep` seconds.
    fn new(now: f64, windows: Vec<UsageTotals>, keep: Option<f64>) -> Summing {
        let earliest = windows
            .iter()
            .map(|w| w.from_unix)
            .filter(|&from| from != f64::MIN)
            .chain(keep.map(|k| now - k))
            .fold(f64::INFINITY, f64::min);
        Summing {
            now,
            windows,
            keep,
            earliest,
            ..Summing::default()
        }
    }

    /// Starts from the summary `totals`: every window of all time counts what ended
    /// before it; every other window begins after it was written, so counts none of
    /// that; its open reservations are open.
    fn take(&mut self, totals: LogTotals) {
        self.reset();
        self.latest_end = totals.at;
        let ended = UsageTotals {
            from_unix: f64::MIN,
            by_user: totals.by_user,
            by_gpu: totals.by_gpu,
        };
        for w in self.windows.iter_mut().filter(|w| w.from_unix == f64::MIN) {
            merge(w, ended.clone());
        }
        self.open = totals.open;
        self.open.order_each_once();
    }

    fn add(&mut self, r: &Usage) {
        for w in &mut self.windows {
            w.add(r, self.now);
        }
    }

    fn ended(&mut self, mut r: Usage, at: f64) {
        r.ended_unix = Some(at.max(r.since_unix));
        self.latest_end = self.latest_end.max(at);
        self.add(&r);
        if let Some(keep) = self.keep {
            if r.ended_unix.is_some_and(|end| end > self.now - keep) {
                r.command = Vec::new();
                self.recent.push_back(r);
                if self.recent.len() > MAX_RECENT {
                    self.recent.pop_front();
                }
            }
        }
    }
}

impl Sink for Summing {
    fn start(&mut self, r: Usage) {
        let (start, id) = (r.since_unix, r.id.clone());
        for (ended, at) in self.open.start(id, start, r) {
            self.ended(ended, at);
        }
    }

    fn end(&mut self, id: &str, time: f64, status: Option<i32>, lost: bool) {
        if let Some(mut r) = self.open.by_id.remove(id) {
            r.status = status;
            r.lost = lost;
            self.ended(r, time);
        }
    }

    fn alive(&mut self, id: &str, time: f64) {
        if let Some(r) = self.open.by_id.get_mut(id) {
            r.alive = Some(r.alive.map_or(time, |a| a.max(time)));
        }
    }

    fn skipped(&mut self, why: String) {
        self.skipped.push(why);
    }

    fn ignored(&mut self, why: Ignored) {
        self.ignored.push(why);
    }

    fn reset(&mut self) {
        self.open = crate::tally::Opens::default();
        for w in &mut self.windows {
            *w = UsageTotals {
                from_unix: w.from_unix,
                ..UsageTotals::default()
            };
        }
        self.skipped.clear();
        self.ignored.clear();
        self.recent.clear();
        self.last_summary = None;
        self.latest_end = 0.0;
        self.unread = None;
        self.started = None;
    }

    // Taken only as a reader new to the log starts ([`fresh`]); read on, a summary
    // only says where the log's last one is.
    fn summary(&mut self, line: SummaryLine, believed: &dyn Fn(&str) -> bool) -> bool {
        let at = line.at;
        if totals_of(line, self.now, believed).is_some() {
            self.last_summary = Some(at);
        }
        false
    }
}

/// `usage`'s totals of one log as its owner summarized them (a
/// [`crate::UsageEvent::Summary`]'s `totals`): where a reader new to the log starts.
#[derive(Debug, Serialize, Deserialize)]
struct LogTotals {
    /// The latest end counted in it (written then, or later): a window that begins
    /// no earlier counts nothing of it.
    at: f64,
    /// Where the log's previous summary of totals begins, when there is one.
    prev: Option<u64>,
    /// The reservations that ended before it, per user...
    by_user: BTreeMap<String, UsageTotal>,
    /// ...and per GPU.
    by_gpu: BTreeMap<String, UsageTotal>,
    /// Those still open (written flat, as `open`, `order` and `latest`).
    #[serde(flatten)]
    open: Opens<Usage>,
}

/// The totals of the summary `line`, read at `now`, when they are ones its owner's
/// records can add up to: every number finite, no time past now (with the slack every
/// record's time has), no more open reservations than a reader keeps, every user named
/// one that passes `believed` (the log's owner).
fn totals_of(line: SummaryLine, now: f64, believed: &dyn Fn(&str) -> bool) -> Option<LogTotals> {
    let totals: LogTotals = serde_json::from_value(line.totals?).ok()?;
    let time = |t: f64| (0.0..=now + crate::usage::TIME_SLACK).contains(&t);
    let ended = |t: &UsageTotal| {
        t.running == 0
            && t.lost <= t.reservations
            && [t.gpu_seconds, t.reserved_byte_seconds]
                .iter()
                .all(|v| v.is_finite() && *v >= 0.0)
    };
    let open = &totals.open;
    let sane = time(totals.at)
        && totals.prev.is_none_or(|p| p < line.at)
        && totals.by_user.iter().all(|(u, t)| believed(u) && ended(t))
        && totals.by_gpu.values().all(ended)
        && open.by_id.len() <= MAX_OPEN
        && open.order.len() <= 2 * MAX_OPEN
        && time(open.latest)
        && open.by_id.iter().all(|(id, r)| {
            *id == r.id
                && believed(&r.user)
                && r.ended_unix.is_none()
                && time(r.since_unix)
                && r.alive.is_none_or(time)
        });
    sane.then_some(totals)
}

/// Summaries a reader new to a log walks back through to the one its windows start
/// from: at one every [`SUMMARY_EVERY`] bytes, 8 GiB of an honest log.
const MAX_HOPS: usize = 1 << 16;

/// The most a reader reads of a log from its start, when the log's first summary of
/// totals was written after a window it adds up begins (the log's history from before
/// such summaries): about two years of a busy user's reservations.
const MAX_FROM_START: u64 = 64 << 20;

/// Where a reader new to a log starts ([`start_of`]).
#[derive(Debug)]
enum Start {
    /// Nowhere: the log is not read, for this reason.
    Unread(String),
    /// At its first line.
    First,
    /// At the summary at byte `at`, of `len` bytes (without its newline).
    At {
        at: u64,
        len: u64,
        totals: LogTotals,
    },
}

/// A log as [`start_of`] found it.
#[derive(Debug)]
struct Found {
    file: (u64, u64),
    len: u64,
    /// Where its last summary of totals is, when there is one among its last MiB.
    last: Option<u64>,
    start: Start,
}

/// Where a reader new to the log at `path`, reading it at `now`, starts: at the last
/// summary of totals written no later than `earliest`, found from the last one among
/// the log's last [`SUMMARY_SEARCH`] bytes and back along the summaries' chain; at its
/// first line when the log is that short and has none, or when its first summary came
/// after `earliest` (at most [`MAX_FROM_START`] bytes). Otherwise the log is not read:
/// what its owner wrote costs them, not every reader. `None`: not a file to read.
fn start_of(path: &Path, now: f64, earliest: f64) -> Option<Found> {
    let tail = crate::usage::summary_lines(path)?;
    let believed = |user: &str| crate::owner::check(path, tail.owner, user).is_ok();
    let read = |at: u64, line: &[u8]| {
        let totals = summary_line(at, line)?;
        totals_of(totals, now, &believed).map(|t| (at, line.len() as u64, t))
    };
    let mut found = Found {
        file: tail.file,
        len: tail.len,
        last: None,
        start: Start::First,
    };
    let last = tail.summaries.iter().find_map(|(at, line)| read(*at, line));
    let Some((mut at, mut len, mut totals)) = last else {
        if tail.len > SUMMARY_SEARCH {
            found.start = Start::Unread(format!(
                "more than {} MiB of it past its last summary",
                SUMMARY_SEARCH >> 20
            ));
        }
        return Some(found);
    };
    found.last = Some(at);
    let mut hops = 0;
    while totals.at > earliest {
        let why = match totals.prev {
            // The first summary: the history before it is read from the start.
            None if tail.len <= MAX_FROM_START => return Some(found),
            None => format!(
                "the window begins before its first summary, more than {} MiB into it",
                MAX_FROM_START >> 20
            ),
            Some(_) if hops == MAX_HOPS => {
                format!("the window begins more than {MAX_HOPS} summaries back")
            }
            Some(prev) => match line_at(path, tail.file, prev).and_then(|l| read(prev, &l)) {
                Some(earlier) => {
                    (at, len, totals) = earlier;
                    hops += 1;
                    continue;
                }
                None => format!("its summary at byte {at} names no summary before it"),
            },
        };
        found.start = Start::Unread(why);
        return Some(found);
    }
    found.start = Start::At { at, len, totals };
    Some(found)
}

/// The log at `path`, as a reader new to it starts into `sink` ([`start_of`]); when it
/// is not read, why is in `sink.unread`.
fn fresh(path: &Path, sink: Summing) -> Tailed<Summing> {
    let mut log = Tailed::new(sink);
    if let Some(found) = start_of(path, log.sink.now, log.sink.earliest) {
        begin(&mut log, found);
    }
    log
}

/// `log`, not read yet, started where `found` says.
fn begin(log: &mut Tailed<Summing>, found: Found) {
    log.seen(found.file, found.len);
    match found.start {
        Start::Unread(why) => {
            log.set_unread();
            log.sink.unread = Some(why);
        }
        Start::First => {}
        Start::At { at, len, totals } => {
            log.sink.take(totals);
            log.sink.started = Some(at);
            log.at_summary(at, len);
        }
    }
    // (After `take`, which forgets it.)
    log.sink.last_summary = found.last;
}

/// Whether a reader that holds `log` reads on from it and then holds what a reader new
/// to the log holds, which starts where `found` says: the same file, grown, and the same
/// start (a log not read is looked at anew).
fn reads_on(log: &Tailed<Summing>, found: &Found) -> bool {
    let same_start = match found.start {
        Start::Unread(_) => false,
        Start::First => log.sink.started.is_none(),
        Start::At { at, .. } => log.sink.started == Some(at),
    };
    same_start && !log.unread() && log.file_and_len().0 == found.file && found.len >= log.offset()
}

/// The summary `line` at byte `at` of a log, when it is one that says it is there.
fn summary_line(at: u64, line: &[u8]) -> Option<SummaryLine> {
    match serde_json::from_slice(line).ok()? {
        crate::UsageEvent::Summary {
            upto,
            half_life,
            state,
            totals,
        } if upto == at => Some(SummaryLine {
            at,
            half_life,
            state,
            totals,
        }),
        _ => None,
    }
}

/// The line at byte `at` of the log at `path` (still the file `file`), without its
/// newline; `None` past [`crate::usage::MAX_LINE`] bytes.
fn line_at(path: &Path, file: (u64, u64), at: u64) -> Option<Vec<u8>> {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let (f, meta) = crate::file::open_to_read(path)?;
    if (meta.dev(), meta.ino()) != file {
        return None;
    }
    let mut line = Vec::new();
    let mut chunk = vec![0u8; 4096];
    while line.len() <= crate::usage::MAX_LINE {
        let n = f.read_at(&mut chunk, at + line.len() as u64).ok()?;
        if n == 0 {
            return None;
        }
        if let Some(end) = memchr::memchr(b'\n', &chunk[..n]) {
            line.extend_from_slice(&chunk[..end]);
            return Some(line);
        }
        line.extend_from_slice(&chunk[..n]);
    }
    None
}

/// The log at `path` of `uid`, as it is not read ([`fresh`]): reported.
fn not_read(path: &Path, uid: u32, log: &Tailed<Summing>) -> Option<Ignored> {
    // (A log whose reading stopped says why among the lines skipped.)
    let why = log.sink.unread.as_ref()?;
    let owner = crate::owner::name_of_uid(uid);
    Some(Ignored::because(
        path,
        uid,
        &owner,
        format!(
            "usage log not read: {why}; {owner}'s use is not counted until their next \
             reservation summarizes it"
        ),
    ))
}

/// Summarizes this user's own log at `path` in `dir` for readers new to it, when more
/// than [`SUMMARY_EVERY`] bytes of it lie past its last summary of totals: its totals
/// as [`LockDir::usage_totals`] adds them up, the reservations of holders found dead
/// ended as it ends them. A log that others do not read is read whole, at this user's
/// cost. Whether a summary was written.
pub(crate) fn summarize_own_totals(dir: &LockDir, path: &Path) -> Result<bool> {
    let uid = crate::owner::euid();
    let now = tt_device::now_unix();
    let summing = || Summing::new(now, vec![UsageTotals::from(f64::MIN)], None);
    let mut log = fresh(path, summing());
    let since = |log: &Tailed<Summing>| log.file_and_len().1 - log.sink.last_summary.unwrap_or(0);
    if !log.unread() && since(&log) < SUMMARY_EVERY {
        return Ok(false);
    }
    if log.unread() {
        log = Tailed::new(summing());
    }
    read_more(path, uid, &mut log, true)?;
    if log.unread() || log.offset() - log.sink.last_summary.unwrap_or(0) < SUMMARY_EVERY {
        return Ok(false);
    }
    // Read after the log: a start read has its live record already.
    let live = dir.live_usage_ids()?;
    let upto = log.offset();
    let mut sums = log.sink;
    let dead: Vec<String> = sums
        .open
        .by_id
        .iter()
        .filter(|(id, r)| {
            !live.contains(&(r.user.clone(), (*id).clone()))
                && lost_end(r.since_unix, r.alive, f64::INFINITY) <= now
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in dead {
        if let Some(mut r) = sums.open.by_id.remove(&id) {
            r.lost = true;
            let end = lost_end(r.since_unix, r.alive, now);
            sums.ended(r, end);
        }
    }
    sums.open.order_each_once();
    for r in sums.open.by_id.values_mut() {
        r.command = Vec::new();
    }
    let all = sums.windows.swap_remove(0);
    let totals = LogTotals {
        at: sums.latest_end,
        prev: sums.last_summary,
        by_user: all.by_user,
        by_gpu: all.by_gpu,
        open: sums.open,
    };
    let Ok(totals) = serde_json::to_value(&totals) else {
        return Ok(false);
    };
    Ok(crate::usage::append_summary(
        path,
        upto,
        0.0,
        serde_json::Value::Null,
        Some(totals),
    ))
}

impl LockDir {
    /// Appends `event` to this user's log, in one write. A log that cannot be written
    /// is a warning, never a reason to refuse or keep a lock. When another user put a
    /// file under this user's log's name first, the records go to a log of this user's
    /// own beside it ([`own_log`]), and the planted file is named in the warning.
    pub(crate) fn record(&self, event: &impl Serialize) {
        let log = self.usage_log.get_or_init(|| {
            match crate::usage::own_log(self.path(), crate::owner::euid()) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(
                        "cannot open the GPU usage log {}: {e}; this reservation is not \
                         accounted: fix the lock directory ({}) or ask its owner",
                        self.own_log_path().display(),
                        self.path().display()
                    );
                    None
                }
            }
        });
        let Some(log) = log else { return };
        match crate::usage::write_line(log, event) {
            Ok(written) => self.summarize_if_due(log, written),
            Err(e) => tracing::warn!(
                "cannot record GPU usage in {}: {e}",
                self.own_log_path().display()
            ),
        }
    }

    /// After `written` bytes were appended to this user's `log`: its totals summarized
    /// for `usage`'s readers (this module's) when it grew past a multiple of
    /// [`SUMMARY_EVERY`] bytes, or, at this process's first record, when
    /// its last summary is that far back (a log from before summaries of totals).
    fn summarize_if_due(&self, log: &crate::file::OwnLog, written: usize) {
        let Ok(len) = log.file.metadata().map(|m| m.len()) else {
            return;
        };
        let every = SUMMARY_EVERY;
        let first = !log.checked.swap(true, std::sync::atomic::Ordering::Relaxed);
        let crossed = len / every != len.saturating_sub(written as u64) / every;
        if (first && len >= every) || crossed {
            if let Err(e) = summarize_own_totals(self, &log.path) {
                tracing::warn!("cannot summarize the GPU usage log: {e}");
            }
        }
    }
}

/// A long-running reader of a lock directory's usage logs (`serve`'s): each reading
/// reads only what was appended since the last, keeping each log's all-time totals,
/// its open reservations and those that ended within `keep` before now; so a reading
/// costs what was appended, whatever the history.
#[derive(Debug)]
pub struct UsageWatch {
    keep: f64,
    logs: HashMap<std::path::PathBuf, Tailed<Summing>>,
}

impl UsageWatch {
    /// A reader that can give windows of up to `keep` before now.
    pub fn new(keep: std::time::Duration) -> UsageWatch {
        UsageWatch {
            keep: keep.as_secs_f64(),
            logs: HashMap::new(),
        }
    }

    /// Reads on in `dir`'s usage logs: what [`LockDir::usage_totals`] gives for all
    /// time and then for each of `recent` before now (each at most this watch's
    /// `keep`: a longer one counts only what was kept).
    pub fn read(&mut self, dir: &LockDir, recent: &[std::time::Duration]) -> Result<UsageSummed> {
        let now = tt_device::now_unix();
        let (logs, ignored) = dir.usage_logs()?;
        let present: HashSet<&std::path::PathBuf> = logs.iter().map(|(p, _)| p).collect();
        self.logs.retain(|path, _| present.contains(path));
        let keep = self.keep;
        for (path, uid) in &logs {
            // Read on while a reader new to the log would start where this one did
            // (whatever its owner wrote in it); else started anew, as that one starts.
            let found = start_of(path, now, now - keep);
            let reading_on = self
                .logs
                .get(path)
                .zip(found.as_ref())
                .is_some_and(|(log, found)| reads_on(log, found));
            if !reading_on {
                let all = vec![UsageTotals::from(f64::MIN)];
                let mut log = Tailed::new(Summing::new(now, all, Some(keep)));
                if let Some(found) = found {
                    begin(&mut log, found);
                }
                self.logs.insert(path.clone(), log);
            }
            let Some(log) = self.logs.get_mut(path) else {
                continue;
            };
            log.sink.now = now;
            read_more(path, *uid, log, true)?;
            log.sink
                .recent
                .retain(|r| r.ended_unix.is_some_and(|end| end > now - keep));
        }
        // Read after the logs: a start read has its live record already.
        let live: HashSet<(String, String)> = dir.live_usage_ids()?;
        let mut out = UsageSummed {
            windows: std::iter::once(UsageTotals::from(f64::MIN))
                .chain(
                    recent
                        .iter()
                        .map(|d| UsageTotals::from(now - d.as_secs_f64())),
                )
                .collect(),
            skipped: Vec::new(),
            ignored,
        };
        for (path, uid) in &logs {
            let Some(log) = self.logs.get(path) else {
                continue;
            };
            out.ignored.extend(not_read(path, *uid, log));
            let sums = &log.sink;
            merge(&mut out.windows[0], sums.windows[0].clone());
            for w in out.windows.iter_mut().skip(1) {
                for r in &sums.recent {
                    w.add(r, now);
                }
            }
            for r in sums.open.by_id.values() {
                let r = ended_if_lost(r.clone(), &live, now);
                for w in &mut out.windows {
                    w.add(&r, now);
                }
            }
            out.skipped.extend(sums.skipped.iter().cloned());
            out.ignored.extend(sums.ignored.iter().cloned());
        }
        Ok(out)
    }
}

/// `r`, still open when read, as ended by its holder's death when no live record
/// carries it (as [`LockDir::usage`] ends it).
fn ended_if_lost(mut r: Usage, live: &HashSet<(String, String)>, now: f64) -> Usage {
    if !live.contains(&(r.user.clone(), r.id.clone())) {
        r.ended_unix = Some(lost_end(r.since_unix, r.alive, now));
        r.lost = true;
    }
    r
}

impl LockDir {
    /// Each user's and each GPU's use from each time in `from` on (seconds since the
    /// epoch; `f64::MIN` for all time), up to now: what [`LockDir::usage`]'s records add
    /// up to (a reservation counted when it ended after the window began or still runs,
    /// from the window's start; one whose holder died holding its GPU ended as
    /// [`LockDir::usage`] ends it, marked lost), read as a stream: the memory this takes
    /// is bounded by the reservations open at once, at most 4096 per log (past that the
    /// oldest is counted as ended when that log's next reservation started; only a
    /// log's own writer can open so many), whatever the history. Nothing is written.
    pub fn usage_totals(&self, from: &[f64]) -> Result<UsageSummed> {
        let now = tt_device::now_unix();
        let windows: Vec<UsageTotals> = from
            .iter()
            .map(|&from_unix| UsageTotals {
                from_unix,
                ..UsageTotals::default()
            })
            .collect();
        let (logs, ignored) = self.usage_logs()?;
        let mut out = UsageSummed {
            windows: windows.clone(),
            skipped: Vec::new(),
            ignored,
        };
        let mut open: Vec<Usage> = Vec::new();
        for (path, uid) in logs {
            let mut log = fresh(&path, Summing::new(now, windows.clone(), None));
            read_more(&path, uid, &mut log, false)?;
            out.ignored.extend(not_read(&path, uid, &log));
            let sums = log.sink;
            for (all, one) in out.windows.iter_mut().zip(sums.windows) {
                merge(all, one);
            }
            out.skipped.extend(sums.skipped);
            out.ignored.extend(sums.ignored);
            open.extend(sums.open.by_id.into_values());
        }
        // Read after the logs: a start read has its live record already.
        let live: HashSet<(String, String)> = self.live_usage_ids()?;
        for r in open {
            let r = ended_if_lost(r, &live, now);
            for w in &mut out.windows {
                w.add(&r, now);
            }
        }
        Ok(out)
    }
}

impl LockDir {
    /// Calls `each` with every reservation this user's own logs record the start of
    /// (as read, without its end), a line at a time: what a user's own tools look up
    /// in their own history (the GPUs a process of theirs reserved) without reading
    /// every user's logs into memory.
    pub fn each_own_start(&self, each: impl FnMut(&Usage)) -> Result<()> {
        /// Every start, to `each`.
        struct Starts<F>(F);
        impl<F: FnMut(&Usage)> Sink for Starts<F> {
            fn start(&mut self, record: Usage) {
                (self.0)(&record);
            }
            fn end(&mut self, _: &str, _: f64, _: Option<i32>, _: bool) {}
            fn alive(&mut self, _: &str, _: f64) {}
            fn skipped(&mut self, _: String) {}
            fn ignored(&mut self, _: Ignored) {}
            fn reset(&mut self) {}
        }
        let me = crate::owner::euid();
        let (logs, _) = self.usage_logs()?;
        let mut state = Tailed::new(Starts(each));
        for (path, uid) in logs.into_iter().filter(|(_, uid)| *uid == me) {
            let each = state.sink;
            state = Tailed::new(each);
            read_more(&path, uid, &mut state, true)?;
        }
        Ok(())
    }
}

/// Adds `one`'s totals into `all`'s.
fn merge(all: &mut UsageTotals, one: UsageTotals) {
    for (mine, theirs) in [
        (&mut all.by_user, one.by_user),
        (&mut all.by_gpu, one.by_gpu),
    ] {
        for (name, t) in theirs {
            let m = mine.entry(name).or_default();
            m.reservations += t.reservations;
            m.running += t.running;
            m.lost += t.lost;
            m.gpu_seconds += t.gpu_seconds;
            m.reserved_byte_seconds += t.reserved_byte_seconds;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// A new lock directory (in the returned temporary directory), this user's name and
    /// their log's path there.
    fn own_log() -> (tempfile::TempDir, LockDir, String, std::path::PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let uid = crate::owner::euid();
        let path = dir.usage_log_path(uid);
        (tmp, dir, crate::owner::name_of_uid(uid), path)
    }

    /// The totals `records` (as [`LockDir::usage`] gives them) add up to from `from`.
    fn from_records(records: &[Usage], from: f64, now: f64) -> UsageTotals {
        let mut totals = UsageTotals {
            from_unix: from,
            ..UsageTotals::default()
        };
        for r in records {
            totals.add(r, now);
        }
        totals
    }

    fn close(a: &UsageTotals, b: &UsageTotals) -> bool {
        let same = |x: &BTreeMap<String, UsageTotal>, y: &BTreeMap<String, UsageTotal>| {
            x.len() == y.len()
                && x.iter().all(|(k, t)| {
                    y.get(k).is_some_and(|u| {
                        (t.reservations, t.running, t.lost) == (u.reservations, u.running, u.lost)
                            // The two readings' clocks a moment apart (a window's
                            // start with them).
                            && (t.gpu_seconds - u.gpu_seconds).abs() < 0.5
                            && (t.reserved_byte_seconds - u.reserved_byte_seconds).abs()
                                <= 1e-4 * t.reserved_byte_seconds.abs().max(1.0)
                    })
                })
        };
        same(&a.by_user, &b.by_user) && same(&a.by_gpu, &b.by_gpu)
    }

    /// [`close`], for two readings whose windows begin a moment apart while many
    /// reservations cross their start: the same counts, the times within 1e-4.
    fn roughly(a: &UsageTotals, b: &UsageTotals) -> bool {
        let same = |x: &BTreeMap<String, UsageTotal>, y: &BTreeMap<String, UsageTotal>| {
            x.len() == y.len()
                && x.iter().all(|(k, t)| {
                    y.get(k).is_some_and(|u| {
                        (t.reservations, t.running, t.lost) == (u.reservations, u.running, u.lost)
                            && (t.gpu_seconds - u.gpu_seconds).abs() <= 1e-4 * t.gpu_seconds
                    })
                })
        };
        same(&a.by_user, &b.by_user) && same(&a.by_gpu, &b.by_gpu)
    }

    #[test]
    fn the_streamed_totals_are_what_every_record_adds_up_to() {
        let (_tmp, dir, me, path) = own_log();
        let now = tt_device::now_unix();
        let start = |id: &str, gpu: u32, t: f64, bytes: Option<u64>| {
            format!(
                "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{me}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"index {gpu}\",\"bytes\":{},\"time\":{t},\"command\":[]}}",
                bytes.map_or("null".to_owned(), |b| b.to_string())
            )
        };
        let end = |id: &str, t: f64| format!("{{\"event\":\"end\",\"id\":\"{id}\",\"time\":{t}}}");
        let mut lines = Vec::new();
        for i in 0..500 {
            let t = now - 30.0 * 86_400.0 + f64::from(i) * 5000.0;
            let id = format!("r{i}");
            lines.push(start(&id, i % 3, t, (i % 2 == 0).then_some(1 << 30)));
            lines.push(end(&id, t + 3000.0));
        }
        // A holder that died holding its GPU (no end, said alive once), a line that
        // cannot be read, a record in another user's name.
        lines.push(start("lost", 1, now - 7200.0, None));
        lines.push(format!(
            "{{\"event\":\"alive\",\"id\":\"lost\",\"time\":{}}}",
            now - 3600.0
        ));
        lines.push("{not json".to_owned());
        lines.push(
            start("forged", 0, now - 100.0, None).replace(&format!("\"{me}\""), "\"someone\""),
        );
        let mut f = std::fs::File::create(&path).unwrap();
        for l in &lines {
            writeln!(f, "{l}").unwrap();
        }
        drop(f);

        let windows = [f64::MIN, now - 86_400.0, now - 7.0 * 86_400.0];
        let summed = dir.usage_totals(&windows).unwrap();
        let log = dir.usage().unwrap();
        let now = tt_device::now_unix();
        for (w, from) in summed.windows.iter().zip(windows) {
            let want = from_records(&log.records, from, now);
            assert!(close(w, &want), "from {from}: {w:?} != {want:?}");
        }
        assert_eq!(summed.windows[0].by_user[&me].reservations, 501);
        assert_eq!(summed.windows[0].by_user[&me].lost, 1);
        assert_eq!(summed.skipped.len(), 1, "{summed:?}");
        assert_eq!(summed.ignored.len(), 1, "{summed:?}");
    }

    #[test]
    fn a_watch_reading_on_gives_what_a_whole_reading_gives() {
        let (_tmp, dir, me, path) = own_log();
        let day = 86_400.0;
        let mut watch = UsageWatch::new(std::time::Duration::from_secs(7 * 86_400));
        let windows = [
            std::time::Duration::from_secs(86_400),
            std::time::Duration::from_secs(7 * 86_400),
        ];
        for round in 0..4u32 {
            let now = tt_device::now_unix();
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap();
            // Ended ones across the last ten days (some across a window's start), one
            // whose holder died long ago, and one line being written.
            for i in 0..200 {
                let t = now - 10.0 * day + f64::from(i) * 4000.0 + f64::from(round);
                let id = format!("r{round}-{i}");
                writeln!(
                    f,
                    "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{me}\",\"host\":\"h\",\
                     \"pid\":1,\"gpu\":\"index {}\",\"bytes\":{},\"time\":{t},\"command\":[]}}\n\
                     {{\"event\":\"end\",\"id\":\"{id}\",\"time\":{}}}",
                    i % 4,
                    1u64 << (20 + i % 10),
                    t + 7000.0
                )
                .unwrap();
            }
            writeln!(
                f,
                "{{\"event\":\"start\",\"id\":\"lost{round}\",\"user\":\"{me}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"index 9\",\"bytes\":null,\"time\":{},\"command\":[]}}",
                now - 3.0 * day
            )
            .unwrap();
            drop(f);
            let along = watch.read(&dir, &windows).unwrap();
            let whole = dir
                .usage_totals(&[
                    f64::MIN,
                    tt_device::now_unix() - day,
                    tt_device::now_unix() - 7.0 * day,
                ])
                .unwrap();
            assert_eq!(along.windows.len(), 3);
            for (a, w) in along.windows.iter().zip(&whole.windows) {
                assert!(close(a, w), "round {round}: {a:?} != {w:?}");
            }
            assert_eq!(
                along.windows[0].by_user[&me].reservations,
                201 * (round as usize + 1)
            );
            assert!(
                along.windows[1].by_user[&me].reservations
                    < along.windows[2].by_user[&me].reservations
            );
        }
        // The watch keeps only what ended in its window, not the whole history.
        let kept: usize = watch.logs.values().map(|l| l.sink.recent.len()).sum();
        assert!(kept < 4 * 200, "{kept}");
    }

    #[test]
    fn a_reader_new_to_a_log_starts_at_the_summary_before_its_windows() {
        let (_tmp, dir, me, path) = own_log();
        let now = tt_device::now_unix();
        let day = 86_400.0;
        let write = |lines: &[String]| {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap();
            for l in lines {
                writeln!(f, "{l}").unwrap();
            }
        };
        let reservation = |id: String, t: f64, open: bool| {
            let mut lines = vec![format!(
                "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{me}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"index {}\",\"bytes\":{},\"time\":{t},\"command\":[]}}",
                id.len() % 4,
                1u64 << (20 + id.len() % 7)
            )];
            if !open {
                lines.push(format!(
                    "{{\"event\":\"end\",\"id\":\"{id}\",\"time\":{}}}",
                    t + 5000.0
                ));
            }
            lines
        };
        // Thirty days of reservations (about 1.6 MB), summarized as their writer
        // summarizes them; a holder that died holding its GPU 20 days ago.
        let (n, span) = (6000, 30.0 * day);
        let mut summaries = 0;
        for i in 0..n {
            // Each ended before now.
            let t = now - span - 6000.0 + span * f64::from(i) / f64::from(n);
            write(&reservation(format!("r{i}"), t, false));
            if i == 2000 {
                write(&reservation("lost".into(), t, true));
            }
            if i % 100 == 99 {
                summaries += usize::from(summarize_own_totals(&dir, &path).unwrap());
            }
        }
        assert!(summaries >= 5, "{summaries}");
        let windows = [f64::MIN, now - day, now - 7.0 * day, now - 20.0 * day];
        let records = dir.usage().unwrap().records;
        // The log's first line damaged (its length kept): a reader that reads it
        // says so, one that starts at a summary after it does not.
        let text = std::fs::read(&path).unwrap();
        let first = memchr::memchr(b'\n', &text).unwrap();
        let mut damaged = text.clone();
        damaged[..first].fill(b'x');
        std::fs::write(&path, &damaged).unwrap();
        let summed = dir.usage_totals(&windows).unwrap();
        let now = tt_device::now_unix();
        for (w, from) in summed.windows.iter().zip(windows) {
            let want = from_records(&records, from, now);
            assert!(close(w, &want), "from {from}: {w:?} != {want:?}");
        }
        assert_eq!(summed.windows[0].by_user[&me].reservations, n as usize + 1);
        assert_eq!(summed.windows[0].by_user[&me].lost, 1);
        assert!(summed.skipped.is_empty(), "read from its start: {summed:?}");
        assert!(summed.ignored.is_empty(), "{summed:?}");
        // A window that begins before the first summary reads the log from its start.
        let all = dir.usage_totals(&[now - 40.0 * day]).unwrap();
        assert_eq!(all.skipped.len(), 1, "{:?}", all.skipped);
        std::fs::write(&path, &text).unwrap();
        // A reader that reads along from its first reading holds the same.
        let mut watch = UsageWatch::new(std::time::Duration::from_secs(7 * 86_400));
        let week = [std::time::Duration::from_secs(86_400)];
        let along = watch.read(&dir, &week).unwrap();
        assert!(along.skipped.is_empty());
        assert!(close(&along.windows[0], &summed.windows[0]));
        assert!(
            roughly(&along.windows[1], &summed.windows[1]),
            "{:?} != {:?}",
            along.windows[1],
            summed.windows[1]
        );

        // More than a MiB written past the last summary: read by nobody, and said so.
        let more: Vec<String> = (0..6000)
            .flat_map(|i| reservation(format!("m{i}"), now - day + f64::from(i), false))
            .collect();
        write(&more);
        let unread = dir.usage_totals(&[f64::MIN]).unwrap();
        assert!(!unread.windows[0].by_user.contains_key(&me), "{unread:?}");
        assert_eq!(unread.ignored.len(), 1, "{unread:?}");
        let why = unread.ignored[0].reason.clone().unwrap_or_default();
        assert!(why.contains("not read"), "{why}");
        let along = watch.read(&dir, &week).unwrap();
        assert!(!along.windows[0].by_user.contains_key(&me));
        assert_eq!(along.ignored, unread.ignored);
        // Until its owner summarizes it, reading it whole (at their cost).
        assert!(summarize_own_totals(&dir, &path).unwrap());
        let records = dir.usage().unwrap().records;
        let read = dir.usage_totals(&windows).unwrap();
        let along = watch.read(&dir, &week).unwrap();
        let now = tt_device::now_unix();
        for (w, from) in read.windows.iter().zip(windows) {
            let want = from_records(&records, from, now);
            assert!(close(w, &want), "from {from}: {w:?} != {want:?}");
        }
        assert!(close(&along.windows[0], &read.windows[0]));
        assert!(roughly(&along.windows[1], &read.windows[1]));
        assert_eq!(
            read.windows[0].by_user[&me].reservations,
            2 * n as usize + 1
        );

        // A summary its owner forged (totals none of their records give): a new reader
        // starts from it, and so does the reader that read along.
        let len = std::fs::metadata(&path).unwrap().len();
        write(&[format!(
            "{{\"event\":\"summary\",\"upto\":{len},\"half_life\":0,\"state\":null,\
             \"totals\":{{\"at\":0,\"prev\":null,\"by_user\":{{\"{me}\":{{\"reservations\":1,\
             \"running\":0,\"lost\":0,\"gpu_seconds\":5.0,\"reserved_byte_seconds\":0.0}}}},\
             \"by_gpu\":{{}},\"open\":{{}},\"order\":[],\"latest\":0.0}}}}"
        )]);
        let forged = dir.usage_totals(&[f64::MIN]).unwrap();
        assert_eq!(forged.windows[0].by_user[&me].reservations, 1, "{forged:?}");
        let along = watch.read(&dir, &week).unwrap();
        assert!(
            close(&along.windows[0], &forged.windows[0]),
            "{:?} != {:?}",
            along.windows[0],
            forged.windows[0]
        );
    }

    #[test]
    fn reservations_summarize_their_log_as_they_write_it() {
        let (_tmp, dir, _, path) = own_log();
        let summaries = || {
            std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .filter(|l| l.contains("\"totals\""))
                .count()
        };
        // A long command line, so that a few hundred reservations make 128 KiB.
        let mut holder = crate::Holder::current();
        holder.who.command = vec!["x".repeat(1000)];
        let mut held = 0;
        while held % 2 == 1 || std::fs::metadata(&path).map_or(0, |m| m.len()) < 3 * SUMMARY_EVERY {
            let lock = dir
                .lock(
                    &crate::GpuKey::Index(held % 2),
                    crate::Wait::Try,
                    holder.clone(),
                )
                .unwrap();
            drop(lock);
            held += 1;
        }
        assert!(summaries() >= 2, "{held} reservations: {}", summaries());
        let summed = dir.usage_totals(&[f64::MIN]).unwrap();
        let records = dir.usage().unwrap().records;
        let want = from_records(&records, f64::MIN, tt_device::now_unix());
        assert!(close(&summed.windows[0], &want), "{summed:?} != {want:?}");
        let per_gpu: Vec<usize> = summed.windows[0]
            .by_gpu
            .values()
            .map(|t| t.reservations)
            .collect();
        assert_eq!(
            per_gpu,
            [held as usize / 2, held as usize / 2],
            "{summed:?}"
        );
    }

    #[test]
    fn junk_keeps_the_summing_bounded() {
        let mut sums = Summing {
            windows: vec![UsageTotals {
                from_unix: f64::MIN,
                ..UsageTotals::default()
            }],
            ..Summing::default()
        };
        for i in 0..3 * crate::tally::MAX_OPEN {
            sums.start(Usage {
                id: format!("j{i}"),
                user: "ada".into(),
                host: "h".into(),
                pid: 1,
                gpu: "index 0".into(),
                bytes: None,
                command: vec![],
                share_of: None,
                since_unix: i as f64,
                ended_unix: None,
                status: None,
                lost: false,
                alive: None,
            });
        }
        assert!(sums.open.by_id.len() <= crate::tally::MAX_OPEN);
        assert!(sums.open.order.len() <= crate::tally::MAX_OPEN);
        assert_eq!(
            sums.windows[0].by_user["ada"].reservations,
            2 * crate::tally::MAX_OPEN
        );
    }
}
