//! What the usage logs add up to per user and per GPU, read as a stream: `usage`,
//! `metrics` and the page's numbers, in memory bounded by the reservations open at once
//! (at most [`crate::tally::MAX_OPEN`] per log) whatever the history and whatever one
//! user wrote into their own log. [`LockDir::usage`] keeps every record instead.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use serde::Serialize;

use crate::usage::{lost_end, read_more, Sink, Tailed, Usage};
use crate::{Ignored, LockDir, Result};

/// One user's (or one GPU's) use from some time on.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
    open: crate::tally::Opens<Usage>,
    windows: Vec<UsageTotals>,
    skipped: Vec<String>,
    ignored: Vec<Ignored>,
    /// For a [`UsageWatch`]: how long ended reservations are kept (seconds before
    /// `now`), and those kept, at most [`MAX_RECENT`].
    keep: Option<f64>,
    recent: VecDeque<Usage>,
}

/// Ended reservations a [`UsageWatch`] keeps per log; past that the oldest kept are
/// forgotten (only a log's own writer can end so many within the watch's window, and
/// then only their own totals of it are short).
const MAX_RECENT: usize = 16_384;

impl Summing {
    fn add(&mut self, r: &Usage) {
        for w in &mut self.windows {
            w.add(r, self.now);
        }
    }

    fn ended(&mut self, mut r: Usage, at: f64) {
        r.ended_unix = Some(at.max(r.since_unix));
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
            let log = self.logs.entry(path.clone()).or_insert_with(|| {
                Tailed::new(Summing {
                    windows: vec![UsageTotals::from(f64::MIN)],
                    keep: Some(keep),
                    ..Summing::default()
                })
            });
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
        for (path, _) in &logs {
            let Some(log) = self.logs.get(path) else {
                continue;
            };
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
            let mut log = Tailed::new(Summing {
                now,
                windows: windows.clone(),
                ..Summing::default()
            });
            read_more(&path, uid, &mut log, false)?;
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

    #[test]
    fn the_streamed_totals_are_what_every_record_adds_up_to() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
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
        let mut f = std::fs::File::create(dir.usage_log_path(uid)).unwrap();
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
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let uid = crate::owner::euid();
        let me = crate::owner::name_of_uid(uid);
        let path = dir.usage_log_path(uid);
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
