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
    open: HashMap<String, Usage>,
    order: VecDeque<String>,
    latest: f64,
    windows: Vec<UsageTotals>,
    skipped: Vec<String>,
    ignored: Vec<Ignored>,
}

impl Summing {
    fn add(&mut self, r: &Usage) {
        for w in &mut self.windows {
            w.add(r, self.now);
        }
    }

    fn ended(&mut self, mut r: Usage, at: f64) {
        r.ended_unix = Some(at.max(r.since_unix));
        self.add(&r);
    }
}

impl Sink for Summing {
    fn start(&mut self, r: Usage) {
        self.latest = self.latest.max(r.since_unix);
        while self
            .order
            .front()
            .is_some_and(|id| !self.open.contains_key(id))
        {
            self.order.pop_front();
        }
        let (start, id) = (r.since_unix, r.id.clone());
        match self.open.insert(id.clone(), r) {
            // The same id again: the first is taken to have ended when this began.
            Some(earlier) => self.ended(earlier, start),
            None => self.order.push_back(id),
        }
        while self.open.len() > crate::tally::MAX_OPEN {
            let Some(id) = self.order.pop_front() else {
                break;
            };
            if let Some(oldest) = self.open.remove(&id) {
                let at = self.latest;
                self.ended(oldest, at);
            }
        }
    }

    fn end(&mut self, id: &str, time: f64, status: Option<i32>, lost: bool) {
        if let Some(mut r) = self.open.remove(id) {
            r.status = status;
            r.lost = lost;
            self.ended(r, time);
        }
    }

    fn alive(&mut self, id: &str, time: f64) {
        if let Some(r) = self.open.get_mut(id) {
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
        self.open.clear();
        self.order.clear();
        self.latest = 0.0;
        for w in &mut self.windows {
            *w = UsageTotals {
                from_unix: w.from_unix,
                ..UsageTotals::default()
            };
        }
        self.skipped.clear();
        self.ignored.clear();
    }
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
            open.extend(sums.open.into_values());
        }
        // Read after the logs: a start read has its live record already.
        let live: HashSet<(String, String)> = self.live_usage_ids()?;
        for mut r in open {
            if !live.contains(&(r.user.clone(), r.id.clone())) {
                r.ended_unix = Some(lost_end(r.since_unix, r.alive, now));
                r.lost = true;
            }
            for w in &mut out.windows {
                w.add(&r, now);
            }
        }
        Ok(out)
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
                            && (t.gpu_seconds - u.gpu_seconds).abs() < 1e-3
                            && (t.reserved_byte_seconds - u.reserved_byte_seconds).abs()
                                <= 1e-9 * t.reserved_byte_seconds.abs().max(1.0)
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
        assert!(sums.open.len() <= crate::tally::MAX_OPEN);
        assert!(sums.order.len() <= crate::tally::MAX_OPEN);
        assert_eq!(
            sums.windows[0].by_user["ada"].reservations,
            2 * crate::tally::MAX_OPEN
        );
    }
}
