use std::fmt;

use serde::{Deserialize, Serialize};
use tt_device::Bytes;

/// Who asked for a GPU: what a lock's [`Holder`] record and a waiting request's
/// [`crate::Waiter`] ticket both say about the process behind them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requester {
    /// The process.
    pub pid: u32,
    /// Its user name (or uid when the name is unknown).
    pub user: String,
    /// Host name.
    pub host: String,
    /// When it took the lock (a holder) or started waiting (a waiter), in seconds since
    /// the Unix epoch.
    pub since_unix: u64,
    /// GPU memory it said its job needs, when it said.
    #[serde(default)]
    pub reserved: Option<Bytes>,
    /// Command line of the job.
    #[serde(default)]
    pub command: Vec<String>,
    /// Its PID namespace (the inode of `/proc/self/ns/pid`): its `pid` means something
    /// only there. A view from another namespace (a container, or the host looking at
    /// one) says so instead of showing a PID of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_ns: Option<u64>,
    /// The policy file it was made under when that is not the machine's
    /// ([`crate::DEFAULT_POLICY`]: `TORCHTOOLS_POLICY` on a machine without one): every
    /// view says it was made outside the machine's policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// The Slurm job it runs in (`1234`, or `1234_7` for an array task), where it runs
    /// in one: every view names the job, as `squeue` and `scancel` take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm_job: Option<String>,
}

/// The most bytes of command line a record keeps (see [`Requester::fitted`]).
pub(crate) const MAX_COMMAND: usize = 16 << 10;

/// The most bytes of any other text a record keeps.
const MAX_TEXT: usize = 1024;

/// `text` cut to at most `max` bytes at a character's boundary, with `…` when cut.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

impl Requester {
    /// This requester as its record says it: every reader reads a record whole (at most
    /// 64 KiB), so a command line past [`MAX_COMMAND`] bytes keeps the arguments that
    /// fit and then one saying how many were left out, and any other text is cut at
    /// 1 KiB. Without that a long command line (thousands of file names) made its
    /// holder unreadable, shown as a lock with no record.
    pub(crate) fn fitted(&self) -> std::borrow::Cow<'_, Requester> {
        let texts = [&self.user, &self.host]
            .into_iter()
            .chain(&self.policy)
            .chain(&self.slurm_job);
        let command: usize = self.command.iter().map(|a| a.len() + 8).sum();
        if command <= MAX_COMMAND && texts.into_iter().all(|t| t.len() <= MAX_TEXT) {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut fitted = self.clone();
        for text in [&mut fitted.user, &mut fitted.host]
            .into_iter()
            .chain(fitted.policy.as_mut())
            .chain(fitted.slurm_job.as_mut())
        {
            *text = cut(text, MAX_TEXT);
        }
        if command > MAX_COMMAND {
            let mut used = 0;
            let mut kept = Vec::new();
            for arg in &self.command {
                let arg = cut(arg, MAX_COMMAND / 4);
                used += arg.len() + 8;
                if used > MAX_COMMAND - 64 {
                    break;
                }
                kept.push(arg);
            }
            let left = self.command.len() - kept.len();
            if left > 0 {
                kept.push(format!("… ({left} more arguments not recorded)"));
            }
            fitted.command = kept;
        }
        std::borrow::Cow::Owned(fitted)
    }

    /// `made outside the machine's policy (under FILE)` when it was, as views say it.
    pub fn outside_policy(&self) -> Option<String> {
        self.policy
            .as_ref()
            .map(|p| format!("made outside the machine's policy (under {p})"))
    }

    /// `in Slurm job 1234` when it runs in one, as views say it.
    pub fn in_slurm_job(&self) -> Option<String> {
        self.slurm_job.as_ref().map(|j| format!("in Slurm job {j}"))
    }

    /// The start time as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn since_utc(&self) -> String {
        utc(self.since_unix)
    }
}

/// Who holds a GPU lock: written as one JSON line into the lock file while it is held.
///
/// The kernel, not this record, decides whether a lock is held: a holder killed by
/// `kill -9` leaves its record behind, and [`crate::LockDir::list`] shows that GPU as
/// free.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// Who took the lock: process, user, host, since when, for what. In the record its
    /// fields sit beside the others (`"pid": 42, "user": "ada", ..., "gpu": ...`).
    #[serde(flatten)]
    pub who: Requester,
    /// The GPU: its UUID, or `index N` without NVML. Filled in by the lock.
    #[serde(default)]
    pub gpu: String,
    /// The pid of the command the lock was handed to (`torchtools reserve -- CMD`), which
    /// keeps the lock if the taker dies first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_pid: Option<u32>,
    /// GPU memory held by the holder's memory fence on this GPU (`torchtools reserve`
    /// keeps it current), so that others see memory set aside that no process uses yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<Bytes>,
    /// The id of this holding's record in its user's usage log (`usage-UID.jsonl`), set by the
    /// lock: how a reader of the log tells a holder still holding from one that died.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<String>,
    /// The GPU memory budget of a holder that shares the GPU with others
    /// ([`crate::LockDir::lock_shared`]); `None` for an exclusive holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<Bytes>,
    /// A shared request's record while it is being admitted: counted by every other
    /// admission (so two never both take the same room), never shown as a sharer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admitting: bool,
    /// The job may be preempted under the machine's policy (`--preemptible`): its own
    /// `torchtools` stops it (SIGTERM, then SIGKILL after the policy's grace) when a
    /// request of a user below their fair share has waited long enough.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
}

impl Holder {
    /// A record for this process, now: pid, user, host, this process's command line.
    pub fn current() -> Holder {
        Holder {
            who: Requester {
                pid: std::process::id(),
                user: user_name(),
                host: host_name(),
                since_unix: tt_device::now_unix_secs(),
                reserved: None,
                command: std::env::args_os()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect(),
                pid_ns: own_pid_namespace(),
                policy: None,
                slurm_job: tt_device::slurm_job_id(),
            },
            gpu: String::new(),
            command_pid: None,
            fenced: None,
            usage: None,
            share: None,
            admitting: false,
            preemptible: false,
        }
    }

    /// This holder as its record says it ([`Requester::fitted`]).
    pub(crate) fn fitted(&self) -> std::borrow::Cow<'_, Holder> {
        match self.who.fitted() {
            std::borrow::Cow::Borrowed(_) => std::borrow::Cow::Borrowed(self),
            std::borrow::Cow::Owned(who) => std::borrow::Cow::Owned(Holder {
                who,
                ..self.clone()
            }),
        }
    }

    /// Sets the memory the job needs.
    pub fn reserving(mut self, bytes: Bytes) -> Holder {
        self.who.reserved = Some(bytes);
        self
    }

    /// Sets the command line recorded (for a lock taken on behalf of another command).
    pub fn running(mut self, command: impl IntoIterator<Item = impl Into<String>>) -> Holder {
        self.who.command = command.into_iter().map(Into::into).collect();
        self
    }

    /// A record for tests: pid 42, `ada@gpu1`, since the epoch, nothing else.
    #[cfg(test)]
    pub(crate) fn example() -> Holder {
        Holder {
            who: Requester {
                pid: 42,
                user: "ada".into(),
                host: "gpu1".into(),
                since_unix: 0,
                reserved: None,
                command: vec![],
                pid_ns: None,
                policy: None,
                slurm_job: None,
            },
            gpu: String::new(),
            command_pid: None,
            fenced: None,
            usage: None,
            share: None,
            admitting: false,
            preemptible: false,
        }
    }

    /// The start time as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn since_utc(&self) -> String {
        self.who.since_utc()
    }
}

/// One line, its writer's text (user, host, command) with control characters made
/// visible ([`tt_device::printable`]): a record's text reaches other users' terminals.
impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = String::new();
        self.write_line(&mut line)?;
        f.write_str(&tt_device::printable(&line))
    }
}

impl Holder {
    fn write_line(&self, f: &mut impl fmt::Write) -> fmt::Result {
        write!(
            f,
            "pid {}{} ({}@{}) since {}",
            self.who.pid,
            namespace_note(self.who.pid_ns),
            self.who.user,
            self.who.host,
            self.since_utc()
        )?;
        if let Some(pid) = self.command_pid {
            write!(f, ", command pid {pid}")?;
        }
        if let Some(job) = self.who.in_slurm_job() {
            write!(f, ", {job}")?;
        }
        if let Some(note) = self.who.outside_policy() {
            write!(f, ", {note}")?;
        }
        match (self.share, self.who.reserved) {
            (Some(bytes), _) => write!(f, ", sharing the GPU with a budget of {bytes}")?,
            (None, Some(bytes)) => write!(f, ", reserving {bytes}")?,
            (None, None) => {}
        }
        if let Some(bytes) = self.fenced.filter(|b| b.0 > 0) {
            write!(f, ", fencing {bytes}")?;
        }
        if !self.who.command.is_empty() {
            let mut command = self.who.command.join(" ");
            if command.chars().count() > 80 {
                command = command.chars().take(77).collect::<String>() + "...";
            }
            write!(f, ": {command}")?;
        }
        Ok(())
    }
}

/// This process's PID namespace (tt-device's, the one place that reads it).
pub use tt_device::own_pid_namespace;

/// `" in another PID namespace (a container, or the host seen from one)"` when `ns` is known and not ours: a PID
/// from there names another process here, or none.
pub(crate) fn namespace_note(ns: Option<u64>) -> &'static str {
    match (ns, own_pid_namespace()) {
        (Some(theirs), Some(ours)) if theirs != ours => {
            " in another PID namespace (a container, or the host seen from one)"
        }
        _ => "",
    }
}

/// Seconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS UTC` (proleptic Gregorian), as
/// holder records and the queue show times.
pub fn utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// This process's user as records name it: the name of its effective uid, which is
/// what readers check a record against (the owner of its file), never `$USER`.
fn user_name() -> String {
    crate::owner::name_of_uid(crate::owner::euid())
}

pub(crate) fn host_name() -> String {
    tt_device::host_name()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_400_000), "2026-11-23 02:13:20 UTC");
    }

    #[test]
    fn current_names_this_process() {
        let h = Holder::current().reserving(Bytes::gib(6));
        assert_eq!(h.who.pid, std::process::id());
        assert!(!h.who.user.is_empty() && !h.who.host.is_empty());
        let text = h.to_string();
        assert!(text.contains("reserving 6.00 GiB"), "{text}");
        let json = serde_json::to_string(&h).unwrap_or_default();
        let back: Holder = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
        assert_eq!(back, h);
    }

    /// Records and tickets written by other versions (and read by other tools) are one
    /// flat JSON object: who asked sits beside the rest, never under a key of its own.
    #[test]
    fn who_asked_is_part_of_the_records_flat_json() {
        let written = r#"{"pid":7,"user":"ada","host":"gpu1","since_unix":951782400,"reserved":1024,"command":["python","train.py"],"gpu":"index 0","pid_ns":4026531836,"share":512}"#;
        let holder: Holder = serde_json::from_str(written).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(holder.who.pid, 7);
        assert_eq!(holder.who.user, "ada");
        assert_eq!(holder.who.since_utc(), "2000-02-29 00:00:00 UTC");
        assert_eq!(holder.who.reserved, Some(Bytes(1024)));
        assert_eq!(holder.who.command, ["python", "train.py"]);
        assert_eq!(holder.who.pid_ns, Some(4_026_531_836));
        assert_eq!(holder.share, Some(Bytes(512)));
        let again: serde_json::Value = serde_json::to_value(&holder).unwrap_or_default();
        assert_eq!(
            again,
            serde_json::from_str::<serde_json::Value>(written).unwrap_or_default()
        );

        let ticket = r#"{"ticket":3,"pid":8,"user":"bo","host":"h","since_unix":5,"wants":{"kind":"gpus","gpus":[{"index":0}]}}"#;
        let waiter: crate::Waiter = serde_json::from_str(ticket).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (waiter.ticket, waiter.who.pid, waiter.who.user.as_str()),
            (3, 8, "bo")
        );
        let again = serde_json::to_value(&waiter).unwrap_or_default();
        assert!(again.get("who").is_none() && again["pid"] == 8, "{again}");
    }
}

#[cfg(test)]
mod display_tests {
    use super::*;
    use crate::owner::user_name_of;

    #[test]
    fn utc_dates_are_the_calendars() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC"); // a leap day
        assert_eq!(utc(1_795_453_057), "2026-11-23 16:57:37 UTC");
        assert_eq!(utc(4_107_542_399), "2100-02-28 23:59:59 UTC"); // 2100: no leap day
        assert_eq!(utc(4_107_542_400), "2100-03-01 00:00:00 UTC");
    }

    fn holder() -> Holder {
        Holder::example()
    }

    #[test]
    fn display_says_who_since_when_how_much_and_what() {
        let mut h = holder();
        assert_eq!(h.since_utc(), "1970-01-01 00:00:00 UTC");
        assert_eq!(
            h.to_string(),
            "pid 42 (ada@gpu1) since 1970-01-01 00:00:00 UTC"
        );
        h.command_pid = Some(7);
        h = h.reserving(Bytes::gib(2)).running(["python", "train.py"]);
        assert_eq!(
            h.to_string(),
            format!(
                "pid 42 (ada@gpu1) since 1970-01-01 00:00:00 UTC, command pid 7, reserving {}: \
                 python train.py",
                Bytes::gib(2)
            )
        );
        // Memory fenced is shown when there is some (a fence of 0 is no fence).
        let mut fencing = holder();
        fencing.fenced = Some(Bytes(0));
        assert_eq!(fencing.to_string(), holder().to_string());
        fencing.fenced = Some(Bytes::gib(3));
        assert_eq!(
            fencing.to_string(),
            format!(
                "pid 42 (ada@gpu1) since 1970-01-01 00:00:00 UTC, fencing {}",
                Bytes::gib(3)
            )
        );
        // A long command is cut at 80 characters, an 80-character one is not.
        let exact = "x".repeat(80);
        assert!(holder()
            .running([exact.clone()])
            .to_string()
            .ends_with(&exact));
        let long = holder().running(["y".repeat(81)]).to_string();
        assert!(long.ends_with(&format!("{}...", "y".repeat(77))), "{long}");
    }

    #[test]
    fn a_uid_without_a_passwd_entry_has_no_name() {
        assert_eq!(user_name_of(0).as_deref(), Some("root"));
        // Far above any uid the system hands out: getpwuid_r finds no entry.
        assert_eq!(user_name_of(4_000_000_123), None);
    }

    #[test]
    fn the_current_holder_is_this_process_user_and_host() {
        let h = Holder::current();
        assert_eq!(h.who.pid, std::process::id());
        // The user: the passwd entry of this uid, as `id -un` prints it.
        let id = std::process::Command::new("id")
            .arg("-un")
            .output()
            .unwrap();
        assert_eq!(h.who.user, String::from_utf8_lossy(&id.stdout).trim());
        // The host: the kernel's host name.
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(h.who.host, host.trim());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(h.who.since_unix <= now && h.who.since_unix + 60 > now);
    }
}
