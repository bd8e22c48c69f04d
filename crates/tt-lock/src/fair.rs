//! The order in which a policy serves the queue, computed alike by every reader from
//! the believed records: each user's recent use from the usage logs, what each holds
//! now from the holder and sharer records, and the tickets.
//!
//! **Fair share.** A user's recent use is the GPU-seconds of their reservations, each
//! second weighted by `2^(-age / half_life)` (a sharer's seconds count the fraction of
//! the GPU its budget is). A request's priority is `waited / aging - fraction`, where
//! `fraction` (0 to 1) is its user's part of all users' recent use: the user who used
//! least goes first, ties by arrival. Since `fraction` is at most 1, a request that has
//! waited `aging` has a priority at or above every request that arrived after it: no
//! request arriving more than `aging` later is served before it (the starvation bound).
//! A user whose usage log nobody reads (more than a MiB written past its last summary,
//! see [`LockDir::summarize_own_usage`]) is charged one more than that, the heaviest
//! user: requests arriving up to twice `aging` after theirs go first, until their own
//! next request summarizes the log.
//!
//! **Limits.** A request that would take its user past `[limits] gpus` or `share` is
//! held: it keeps its place but blocks nobody, and is served once its user's holdings
//! fall.

use std::collections::HashMap;

use serde::Serialize;
use tt_device::Bytes;

use crate::policy::{Limits, Policy};
use crate::{LockDir, Result, Waiter, Wants};

/// One user's standing under the policy: recent use and what they hold and ask now.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Standing {
    /// The user.
    pub user: String,
    /// Recent use in GPU-seconds, decayed with the policy's half-life (0 without fair
    /// share).
    pub use_gpu_s: f64,
    /// Their part of all users' recent use, 0 to 1.
    pub fraction: f64,
    /// GPUs they hold exclusively now.
    pub gpus: usize,
    /// Bytes they have budgeted on shared GPUs now.
    pub shared: Bytes,
    /// Their requests waiting in the queue.
    pub waiting: usize,
    /// The processes of their live holder and sharer records (pids as this PID
    /// namespace numbers them; in another, as their records say).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pids: Vec<u32>,
    /// Why their recent use is not known: a usage log of theirs that nobody reads,
    /// since they wrote more than a MiB into it past their last summary (see
    /// [`LockDir::summarize_own_usage`]). They then stand as the heaviest user
    /// (`fraction` 1, and their use counts in nobody else's fraction) until their own
    /// next request summarizes it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unread: Option<String>,
    /// Why they hold more than the policy's per-user limits let one user have at once
    /// (`holds 2 GPU(s), over the policy's limit of 1`), whatever their processes
    /// believed the policy was; `None` within them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
}

impl Standing {
    /// Why this user holds more than `limits` allow, if they do.
    pub fn over_limits(&self, limits: &Limits) -> Option<String> {
        let mut over = Vec::new();
        if let Some(max) = limits.gpus.filter(|&max| self.gpus > max) {
            over.push(format!(
                "holds {} GPU(s), over the policy's limit of {max}",
                self.gpus
            ));
        }
        if let Some(max) = limits.share.filter(|&max| self.shared > max) {
            over.push(format!(
                "has budgeted {} on shared GPUs, over the policy's limit of {max}",
                self.shared
            ));
        }
        (!over.is_empty()).then(|| over.join("; "))
    }

    /// The line a view says for a user over the policy's limits:
    /// `tt2 holds 2 GPU(s), over the policy's limit of 1 (pids 7, 8)`.
    pub fn over_text(&self) -> Option<String> {
        let over = self.over.as_ref()?;
        let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
        Some(format!("{} {over} (pids {})", self.user, pids.join(", ")))
    }

    /// The line a view says for a user whose usage log is not read: `tt2's usage log
    /// /tmp/torchtools-locks/usage-1001.jsonl not read: ...`.
    pub fn unread_text(&self) -> Option<String> {
        let why = self.unread.as_ref()?;
        Some(format!("{}'s {why}", self.user))
    }

    /// What the fair share charges this user: their part of all users' recent use, and
    /// one more for a user whose log is not read, who then comes after every other
    /// user.
    pub(crate) fn charge(&self) -> f64 {
        self.fraction + if self.unread.is_some() { 1.0 } else { 0.0 }
    }

    /// Recent use and its part of everyone's as users read it:
    /// `0.4 GPU-h recent use (12% of all)`.
    pub fn use_text(&self) -> String {
        if self.unread.is_some() {
            return "recent use not read (counted as the heaviest user)".to_owned();
        }
        format!(
            "{:.1} GPU-h recent use ({:.0}% of all)",
            self.use_gpu_s / 3600.0,
            self.fraction * 100.0
        )
    }
}

/// Why a request is held back by `limits`, given its user's standing; `None` when it
/// may be served.
pub(crate) fn held_by(limits: &Limits, standing: &Standing, wants: &Wants) -> Option<String> {
    match wants {
        Wants::Share { bytes, .. } => {
            let limit = limits.share?;
            (standing.shared.0.saturating_add(bytes.0) > limit.0).then(|| {
                format!(
                    "held by policy: {} of {limit} shared, {bytes} more asked",
                    standing.shared
                )
            })
        }
        Wants::Gpus { gpus } => gpus_held_by(limits, standing, gpus.len()),
        Wants::Auto { count, .. } => gpus_held_by(limits, standing, *count),
    }
}

fn gpus_held_by(limits: &Limits, standing: &Standing, asked: usize) -> Option<String> {
    let limit = limits.gpus?;
    (standing.gpus.saturating_add(asked) > limit).then(|| {
        format!(
            "held by policy: {} of {limit} GPU(s) held, {asked} more asked",
            standing.gpus
        )
    })
}

/// A request that can never be served under `limits` (it alone asks for more than a
/// user may hold): the reason, to refuse it rather than keep it waiting forever.
pub(crate) fn never_served(limits: &Limits, wants: &Wants) -> Option<String> {
    let empty = Standing::default();
    held_by(limits, &empty, wants).map(|why| {
        why.replacen(
            "held by policy",
            "asks for more than the policy lets one user have at once",
            1,
        )
    })
}

/// Orders `waiters` as `policy` serves them, at `now` (seconds since the epoch): sets
/// each one's position, priority, reason and hold. Without fair share, by arrival.
pub(crate) fn serve_order(
    waiters: &mut [Waiter],
    policy: &Policy,
    standings: &HashMap<String, Standing>,
    now: u64,
) {
    let empty = Standing::default();
    for w in waiters.iter_mut() {
        let standing = standings.get(&w.who.user).unwrap_or(&empty);
        w.held = held_by(&policy.limits, standing, &w.wants);
        if let Some(fs) = &policy.fair_share {
            let waited = now.saturating_sub(w.who.since_unix) as f64;
            let priority = waited / fs.aging.as_secs_f64() - standing.charge();
            w.priority = Some(priority);
            w.why = Some(format!(
                "{}: {}, waited {}",
                w.who.user,
                standing.use_text(),
                tt_device::format_duration(std::time::Duration::from_secs(
                    now.saturating_sub(w.who.since_unix)
                ))
            ));
        }
    }
    waiters.sort_by(|a, b| {
        let (pa, pb) = (a.priority.unwrap_or(0.0), b.priority.unwrap_or(0.0));
        pb.total_cmp(&pa).then(a.arrival().cmp(&b.arrival()))
    });
    for (i, w) in waiters.iter_mut().enumerate() {
        w.position = i + 1;
    }
}

/// The waiting request that preempts a `--preemptible` job of `user` holding `gpus`
/// under `policy`'s `[preemption]`, with why; `None` when none may. In serving order,
/// the first request that has waited longer than `after`, is not held back by a limit,
/// is another user's, wants one of `gpus`, whose user stands below `user` (with fair
/// share, `user`'s part of recent use is above an equal share, one over the users using
/// or asking for GPUs, and above the waiting user's; without, `user` holds more GPUs
/// than the waiting user), that can then be served, and that needs this job's GPU:
///
/// - every GPU it waits for (`count` of them for an `auto` request) is, in `states`,
///   free or held by preemptible jobs that yield to it by this same rule, so a request
///   that would wait on after the job yields (a GPU it wants held by a job that is not
///   preemptible) preempts nobody;
/// - a request that free GPUs already serve preempts nobody, and an `auto` request
///   stops only as many jobs as it lacks GPUs, the youngest first (every reader picks
///   the same ones): a request stops each job it needs once, and once they have
///   yielded it needs nobody else, whether or not it then takes the GPUs.
pub fn preemptor<'q>(
    policy: &Policy,
    queue: &'q [Waiter],
    standings: &HashMap<String, Standing>,
    user: &str,
    gpus: &[crate::GpuKey],
    states: &[crate::LockState],
    now: u64,
) -> Option<(&'q Waiter, String)> {
    let rule = Yield {
        policy,
        standings,
        now,
    };
    queue.iter().find_map(|w| {
        // Whether this job yields to `w` at all (cheap), before which GPUs `w` needs
        // (which asks the same of every occupant of every GPU it wants).
        rule.why(w, user, gpus)?;
        let needed = rule.needed(w, states);
        let mine: Vec<_> = gpus
            .iter()
            .filter(|k| needed.contains(k))
            .cloned()
            .collect();
        let why = rule.why(w, user, &mine)?;
        Some((w, why))
    })
}

/// How one GPU a waiting request wants stands, for [`preemptor`].
enum Room {
    /// Nobody holds it: the request can take it now.
    Free,
    /// Held only by preemptible jobs that yield to the request; the latest start among
    /// them (the youngest job loses the least when stopped).
    Yields(u64),
    /// Held by something that does not yield: a job that is not preemptible, another
    /// user's job that stands below, a lock with no record.
    Blocked,
}

/// [`preemptor`]'s rule for one waiting request and one job.
struct Yield<'a> {
    policy: &'a Policy,
    standings: &'a HashMap<String, Standing>,
    now: u64,
}

impl Yield<'_> {
    /// Why the job of `user` holding `gpus` yields to `w`, if it does (the whole rule
    /// but whether `w` can then be served).
    fn why(&self, w: &Waiter, user: &str, gpus: &[crate::GpuKey]) -> Option<String> {
        let (policy, standings, now) = (self.policy, self.standings, self.now);
        let after = policy.preemption.as_ref()?.after;
        let empty = Standing::default();
        let mine = standings.get(user).unwrap_or(&empty);
        let active = standings
            .values()
            .filter(|s| s.use_gpu_s > 0.0 || s.waiting > 0 || s.gpus > 0)
            .count()
            .max(1);
        let equal = 1.0 / active as f64;
        let waited = now.saturating_sub(w.who.since_unix);
        let theirs = standings.get(&w.who.user).unwrap_or(&empty);
        let wanted = w.wants.gpus().iter().find(|k| gpus.contains(k))?;
        let above = match policy.fair_share {
            Some(_) => mine.charge() > equal && mine.charge() > theirs.charge(),
            None => mine.gpus > theirs.gpus,
        };
        let eligible = w.held.is_none() && w.who.user != user && waited > after.as_secs() && above;
        eligible.then(|| {
            let standing = match policy.fair_share {
                Some(_) => format!(
                    "{user} is above their fair share ({:.0}% of recent use, an equal share \
                     is {:.0}%; {} {:.0}%)",
                    mine.fraction * 100.0,
                    equal * 100.0,
                    w.who.user,
                    theirs.fraction * 100.0
                ),
                None => format!(
                    "{user} holds {} GPU(s), {} {}",
                    mine.gpus, w.who.user, theirs.gpus
                ),
            };
            format!(
                "pid {} ({}) has waited {} for {wanted} (the policy preempts after {}), and \
                 {standing}",
                w.who.pid,
                w.who.user,
                tt_device::format_duration(std::time::Duration::from_secs(waited)),
                tt_device::format_duration(after),
            )
        })
    }

    /// The GPUs whose jobs must yield for `w` to be served: empty when `w` could be
    /// served without anyone yielding, or would still wait after everyone that yields
    /// to it had (see [`preemptor`]).
    fn needed(&self, w: &Waiter, states: &[crate::LockState]) -> Vec<crate::GpuKey> {
        let yields = |h: &crate::Holder, key: &crate::GpuKey| {
            h.preemptible
                && self
                    .why(w, &h.who.user, std::slice::from_ref(key))
                    .is_some()
        };
        let room = |key: &crate::GpuKey| {
            let Some(state) = states.iter().find(|s| &s.gpu == key) else {
                return Room::Free; // never locked
            };
            if !state.unrecorded.is_empty() || (state.held && state.holder.is_none()) {
                return Room::Blocked;
            }
            // A share asks for room beside the sharers, which the grant checks; an
            // exclusive request needs every sharer gone.
            let sharers = match w.wants {
                Wants::Share { .. } => &[][..],
                _ => &state.shares[..],
            };
            let occupants: Vec<&crate::Holder> = state.holder.iter().chain(sharers).collect();
            if occupants.is_empty() {
                Room::Free
            } else if occupants.iter().all(|h| yields(h, key)) {
                Room::Yields(
                    occupants
                        .iter()
                        .map(|h| h.who.since_unix)
                        .max()
                        .unwrap_or(0),
                )
            } else {
                Room::Blocked
            }
        };
        let wanted = w.wants.gpus();
        let rooms: Vec<(&crate::GpuKey, Room)> = wanted.iter().map(|k| (k, room(k))).collect();
        let free = rooms
            .iter()
            .filter(|(_, r)| matches!(r, Room::Free))
            .count();
        let mut yielding: Vec<(&crate::GpuKey, u64)> = rooms
            .iter()
            .filter_map(|(k, r)| match r {
                Room::Yields(since) => Some((*k, *since)),
                _ => None,
            })
            .collect();
        let count = match &w.wants {
            Wants::Auto { count, .. } => *count,
            other => other.gpus().len(),
        };
        let lacking = count.saturating_sub(free);
        if lacking == 0 || yielding.len() < lacking {
            return Vec::new();
        }
        // The youngest jobs first; a stable sort keeps the request's own order on ties.
        yielding.sort_by_key(|y| std::cmp::Reverse(y.1));
        yielding
            .into_iter()
            .take(lacking)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

impl LockDir {
    /// Every user's standing under `policy`: recent use (with fair share), what each
    /// holds now, and how many requests each has waiting in `queue`. Users are keyed by
    /// name.
    pub fn standings(
        &self,
        policy: &Policy,
        queue: &[Waiter],
    ) -> Result<HashMap<String, Standing>> {
        let mut standings: HashMap<String, Standing> = HashMap::new();
        if let Some(fs) = &policy.fair_share {
            let read = self.recent_use(fs.half_life.as_secs_f64())?;
            let total: f64 = read
                .uses
                .iter()
                .filter(|(user, _)| !read.unread.contains_key(*user))
                .map(|(_, used)| used)
                .sum();
            for (user, used) in read.uses {
                let s = standing_of(&mut standings, &user);
                s.use_gpu_s = used;
                s.fraction = if total > 0.0 { used / total } else { 0.0 };
            }
            // What one user wrote into their own log costs them, not everyone's time.
            for (user, why) in read.unread {
                let s = standing_of(&mut standings, &user);
                s.fraction = 1.0;
                s.unread = Some(why);
            }
        }
        if policy.limits_apply() || policy.preemption.is_some() {
            // What each holds now, from the live, believed holder and sharer records.
            let names = self.names()?;
            let (held, _) = crate::record::live(self.path(), names.iter().cloned(), "held-");
            for found in held {
                let s = standing_of(&mut standings, &found.holder.who.user);
                s.gpus += 1;
                s.pids.push(found.holder.who.pid);
            }
            let (shares, _) = crate::record::live(self.path(), names, "share-");
            for h in shares
                .into_iter()
                .map(|f| f.holder)
                .filter(|h| !h.admitting)
            {
                let s = standing_of(&mut standings, &h.who.user);
                s.shared = Bytes(s.shared.0.saturating_add(h.share.map_or(0, |b| b.0)));
                s.pids.push(h.who.pid);
            }
            for s in standings.values_mut() {
                s.pids.sort_unstable();
                s.pids.dedup();
                s.over = s.over_limits(&policy.limits);
            }
        }
        for w in queue {
            standing_of(&mut standings, &w.who.user).waiting += 1;
        }
        Ok(standings)
    }

    /// Each user's recent use now, decayed with `half_life` seconds, from every user's
    /// usage log as [`LockDir::usage`] reads it (a holder that died holding its GPU is
    /// counted until [`crate::ALIVE_EVERY`] after its last sign of life in its own log,
    /// else until now). The logs are read
    /// on from where this process's last reading of this directory stopped: a decision
    /// reads only the records written since.
    pub(crate) fn recent_use(&self, half_life: f64) -> Result<crate::tally::RecentUse> {
        let (logs, _) = self.usage_logs()?;
        crate::tally::recent_use(
            self.path(),
            &logs,
            half_life,
            || self.live_usage_ids(),
            tt_device::now_unix(),
            crate::tally::cache_file(self.path()).as_deref(),
            true,
        )
    }

    /// Reads the usage logs as a fair-share decision with `half_life` does, and writes
    /// a summary into each of this user's own logs that has grown by about 128 KiB since
    /// its last ([`crate::UsageEvent::Summary`]): what the log adds up to, so that a
    /// process new to the log (a user's first request on the machine, or after a
    /// reboot) reads only what came after it. Every request under a fair-share policy
    /// does this (`torchtools reserve` among them); a tool that writes usage logs of its
    /// own calls it as it writes.
    ///
    /// Readers read a log from its last summary among its last MiB: a log with more
    /// than that written past its last summary is read by nobody, and its owner is
    /// served as the heaviest user ([`Standing::unread`]). This reads such a log of this
    /// user's whole, once, and summarizes it, which ends that (unless the summary is
    /// too long for a line: more than a few hundred reservations open at once).
    ///
    /// It also writes the summary of totals that `usage`, `metrics` and `serve` start
    /// from, into each of this user's logs with 128 KiB past its last (every record
    /// this crate writes does that as it writes).
    pub fn summarize_own_usage(&self, half_life: std::time::Duration) -> Result<()> {
        self.recent_use(half_life.as_secs_f64())?;
        let (logs, _) = self.usage_logs()?;
        let me = crate::owner::euid();
        for (path, _) in logs.iter().filter(|(_, uid)| *uid == me) {
            crate::totals::summarize_own_totals(self, path)?;
        }
        Ok(())
    }

    /// The queue as `policy` serves it (see [`LockDir::queue`]).
    pub(crate) fn ordered(&self, policy: &Policy, mut waiters: Vec<Waiter>) -> Result<Vec<Waiter>> {
        if !policy.orders_the_queue() || waiters.is_empty() {
            return Ok(waiters);
        }
        let standings = self.standings(policy, &waiters)?;
        serve_order(&mut waiters, policy, &standings, tt_device::now_unix_secs());
        Ok(waiters)
    }
}

/// `user`'s entry in `standings`, made when missing.
fn standing_of<'m>(standings: &'m mut HashMap<String, Standing>, user: &str) -> &'m mut Standing {
    standings
        .entry(user.to_owned())
        .or_insert_with(|| Standing {
            user: user.to_owned(),
            ..Standing::default()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FairShare;
    use crate::Usage;
    use crate::{GpuKey, Holder};
    use std::time::Duration;

    fn usage(user: &str, start: f64, end: Option<f64>) -> Usage {
        Usage {
            id: format!("{user}-{start}"),
            user: user.into(),
            host: "h".into(),
            pid: 1,
            gpu: "index 0".into(),
            bytes: None,
            command: vec![],
            share_of: None,
            since_unix: start,
            ended_unix: end,
            status: None,
            lost: false,
            alive: None,
        }
    }

    #[test]
    fn use_decays_by_half_each_half_life_and_a_share_counts_its_part() {
        let day = 86_400.0;
        let now = 100.0 * day;
        // One GPU-hour that ended one half-life ago counts about half an hour.
        let old = crate::tally::decayed_use(
            &[usage("ada", now - day - 3600.0, Some(now - day))],
            now,
            day,
        );
        assert!((old["ada"] / 1800.0 - 1.0).abs() < 0.02, "{old:?}");
        // A fresh hour counts nearly whole; one still held counts up to now.
        let fresh = crate::tally::decayed_use(&[usage("bob", now - 3600.0, None)], now, day);
        assert!((fresh["bob"] / 3600.0 - 1.0).abs() < 0.02, "{fresh:?}");
        // A share of a quarter of the GPU counts a quarter.
        let mut share = usage("cy", now - 3600.0, Some(now));
        share.bytes = Some(20);
        share.share_of = Some(80);
        let quarter = crate::tally::decayed_use(&[share], now, day);
        assert!((quarter["cy"] / 900.0 - 1.0).abs() < 0.02, "{quarter:?}");
    }

    fn waiter(ticket: u64, user: &str, since_unix: u64, gpus: usize) -> Waiter {
        let mut holder = Holder::example();
        holder.who.user = user.into();
        holder.who.since_unix = since_unix;
        let mut w = Waiter::new(
            ticket,
            &holder,
            Wants::Auto {
                count: gpus,
                among: vec![GpuKey::Index(0), GpuKey::Index(1)],
            },
        );
        w.ticket = ticket;
        w
    }

    fn standing(user: &str, fraction: f64, gpus: usize) -> (String, Standing) {
        let s = Standing {
            user: user.into(),
            use_gpu_s: fraction * 36_000.0,
            fraction,
            gpus,
            ..Standing::default()
        };
        (user.into(), s)
    }

    #[test]
    fn the_lighter_user_goes_first_and_nobody_waits_past_the_aging_bound() {
        let policy = Policy {
            fair_share: Some(FairShare {
                half_life: Duration::from_secs(7 * 86_400),
                aging: Duration::from_secs(3600),
            }),
            ..Policy::default()
        };
        let standings: HashMap<_, _> =
            [standing("heavy", 0.9, 0), standing("light", 0.1, 0)].into();
        let now = 1_000_000;
        // Twenty of heavy's, then one of light's: light's goes first.
        let mut queue: Vec<Waiter> = (1..=20).map(|t| waiter(t, "heavy", now - 60, 1)).collect();
        queue.push(waiter(21, "light", now - 1, 1));
        serve_order(&mut queue, &policy, &standings, now);
        assert_eq!(
            (queue[0].who.user.as_str(), queue[0].position),
            ("light", 1)
        );
        // heavy's keep their arrival order among themselves.
        let tickets: Vec<u64> = queue[1..].iter().map(|w| w.ticket).collect();
        assert_eq!(tickets, (1..=20).collect::<Vec<_>>());
        assert!(queue[0]
            .why
            .as_deref()
            .unwrap_or("")
            .contains("light: 1.0 GPU-h"));
        // heavy's request that has waited the aging period goes before light's new one.
        let mut queue = vec![
            waiter(1, "heavy", now - 3600, 1),
            waiter(2, "light", now, 1),
        ];
        serve_order(&mut queue, &policy, &standings, now);
        assert_eq!(queue[0].who.user, "heavy");
    }

    #[test]
    fn a_preemptible_job_yields_only_to_a_long_wait_of_a_user_below_its_share() {
        let mut policy =
            Policy::parse("[fair_share]\nhalf_life = \"1h\"\n[preemption]\nafter = \"30m\"\n")
                .unwrap();
        let standings: HashMap<_, _> =
            [standing("heavy", 0.9, 1), standing("light", 0.1, 0)].into();
        let now = 10_000;
        let gpu0 = [GpuKey::Index(0)];
        let long = [waiter(1, "light", now - 1900, 1)];
        // heavy's preemptible job holds GPU 0, one that is not preemptible GPU 1.
        let held = [
            state(0, Some(("heavy", true))),
            state(1, Some(("heavy", false))),
        ];
        let (w, why) = preemptor(&policy, &long, &standings, "heavy", &gpu0, &held, now).unwrap();
        assert_eq!(w.ticket, 1);
        assert!(
            why.contains("has waited 1900s") && why.contains("90% of recent use"),
            "{why}"
        );
        // Not yet 30 minutes; not a GPU it holds; its own request; a lighter holder.
        let short = [waiter(1, "light", now - 60, 1)];
        assert!(preemptor(&policy, &short, &standings, "heavy", &gpu0, &held, now).is_none());
        assert!(preemptor(
            &policy,
            &long,
            &standings,
            "heavy",
            &[GpuKey::Index(7)],
            &held,
            now
        )
        .is_none());
        let own = [waiter(1, "heavy", now - 1900, 1)];
        assert!(preemptor(&policy, &own, &standings, "heavy", &gpu0, &held, now).is_none());
        assert!(preemptor(&policy, &long, &standings, "light", &gpu0, &held, now).is_none());
        // A request the limits hold back preempts nobody; no [preemption], nothing.
        let mut kept = long.clone();
        kept[0].held = Some("held by policy".into());
        assert!(preemptor(&policy, &kept, &standings, "heavy", &gpu0, &held, now).is_none());
        policy.preemption = None;
        assert!(preemptor(&policy, &long, &standings, "heavy", &gpu0, &held, now).is_none());
    }

    /// GPU `index`'s state: held by a job of `user` (preemptible or not), or free.
    fn state(index: u32, held_by: Option<(&str, bool)>) -> crate::LockState {
        let holder = held_by.map(|(user, preemptible)| {
            let mut h = Holder::example();
            h.who.user = user.into();
            h.preemptible = preemptible;
            h
        });
        crate::LockState {
            gpu: GpuKey::Index(index),
            nvml_index: None,
            name: None,
            path: format!("gpu-{index}.lock").into(),
            held: holder.is_some(),
            holder,
            waiting: 1,
            shares: Vec::new(),
            ignored: Vec::new(),
            unrecorded: Vec::new(),
        }
    }

    #[test]
    fn a_job_is_preempted_only_for_a_request_that_can_then_be_served() {
        let policy =
            Policy::parse("[fair_share]\nhalf_life = \"1h\"\n[preemption]\nafter = \"2s\"\n")
                .unwrap();
        let standings: HashMap<_, _> =
            [standing("heavy", 0.9, 2), standing("light", 0.1, 0)].into();
        let now = 10_000;
        let mut both = waiter(1, "light", now - 60, 2);
        both.wants = Wants::Gpus {
            gpus: vec![GpuKey::Index(0), GpuKey::Index(3)],
        };
        let queue = [both];
        let gpu0 = [GpuKey::Index(0)];
        // GPU 3 held by a job that is not preemptible: the request would still wait.
        let states = [
            state(0, Some(("heavy", true))),
            state(3, Some(("heavy", false))),
        ];
        assert!(preemptor(&policy, &queue, &standings, "heavy", &gpu0, &states, now).is_none());
        // Held by a bare lock with no record: the same.
        let mut bare = states.clone();
        bare[1] = state(3, None);
        bare[1].held = true;
        assert!(preemptor(&policy, &queue, &standings, "heavy", &gpu0, &bare, now).is_none());
        // GPU 3 free, or held by a preemptible job that yields too: preempted.
        for other in [state(3, None), state(3, Some(("heavy", true)))] {
            let states = [state(0, Some(("heavy", true))), other];
            assert!(
                preemptor(&policy, &queue, &standings, "heavy", &gpu0, &states, now).is_some(),
                "{states:?}"
            );
        }
        // An auto request for one of the two: one servable GPU is enough.
        let mut one = waiter(1, "light", now - 60, 1);
        one.wants = Wants::Auto {
            count: 1,
            among: vec![GpuKey::Index(0), GpuKey::Index(3)],
        };
        assert!(preemptor(&policy, &[one], &standings, "heavy", &gpu0, &states, now).is_some());
    }

    #[test]
    fn a_request_stops_only_the_jobs_it_lacks_and_none_once_it_has_room() {
        let policy =
            Policy::parse("[fair_share]\nhalf_life = \"1h\"\n[preemption]\nafter = \"2s\"\n")
                .unwrap();
        let standings: HashMap<_, _> =
            [standing("heavy", 0.9, 3), standing("light", 0.1, 0)].into();
        let now = 10_000;
        let mut one = waiter(1, "light", now - 60, 1);
        one.wants = Wants::Auto {
            count: 1,
            among: (0..3).map(GpuKey::Index).collect(),
        };
        let queue = [one];
        // Three of heavy's preemptible jobs, GPU 1's the youngest: it alone yields.
        let mut states: Vec<_> = (0..3).map(|i| state(i, Some(("heavy", true)))).collect();
        for (i, s) in states.iter_mut().enumerate() {
            s.holder.as_mut().unwrap().who.since_unix = [100, 300, 200][i];
        }
        let yields: Vec<u32> = (0..3)
            .filter(|&i| {
                let gpu = [GpuKey::Index(i)];
                preemptor(&policy, &queue, &standings, "heavy", &gpu, &states, now).is_some()
            })
            .collect();
        assert_eq!(yields, [1]);
        // Once GPU 1 is free the request has room: nobody else yields, taken or not.
        states[1] = state(1, None);
        for i in [0, 2] {
            let gpu = [GpuKey::Index(i)];
            assert!(preemptor(&policy, &queue, &standings, "heavy", &gpu, &states, now).is_none());
        }
        // A request naming GPUs 0 and 1 needs GPU 0's job whatever is free beside it.
        let mut named = waiter(1, "light", now - 60, 2);
        named.wants = Wants::Gpus {
            gpus: vec![GpuKey::Index(0), GpuKey::Index(1)],
        };
        let gpu0 = [GpuKey::Index(0)];
        assert!(preemptor(&policy, &[named], &standings, "heavy", &gpu0, &states, now).is_some());
    }

    #[test]
    fn a_request_past_its_users_limit_is_held_and_one_never_servable_is_named() {
        let policy = Policy {
            limits: Limits {
                gpus: Some(2),
                share: Some(Bytes::gib(80)),
                ..Limits::default()
            },
            ..Policy::default()
        };
        let standings: HashMap<_, _> = [standing("ada", 0.0, 2), standing("bob", 0.0, 1)].into();
        let mut queue = vec![waiter(1, "ada", 0, 1), waiter(2, "bob", 0, 1)];
        serve_order(&mut queue, &policy, &standings, 10);
        assert_eq!(
            queue[0].held.as_deref(),
            Some("held by policy: 2 of 2 GPU(s) held, 1 more asked")
        );
        assert_eq!(queue[1].held, None);
        let share = Wants::Share {
            gpu: GpuKey::Index(0),
            bytes: Bytes::gib(90),
            capacity: Bytes::gib(141),
        };
        let why = never_served(&policy.limits, &share).unwrap_or_default();
        assert!(
            why.contains("more than the policy lets one user have"),
            "{why}"
        );
        assert!(never_served(&policy.limits, &queue[0].wants).is_none());
    }
}
