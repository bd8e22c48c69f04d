//! Who used which GPU for how long: every lock taken appends a record when it is
//! granted and one when it is released to its user's own log in the lock directory,
//! `usage-<uid>.jsonl`: created by that user, mode 0644 whatever the umask, so that
//! every user reads it and nobody else can change or erase it (the sticky directory).
//! A log whose owner is not the uid in its name, and a record that names another user
//! than its log's owner, are ignored and reported. Reading merges every user's log.
//!
//! Nothing is ever written into another user's log: a holder that died without
//! releasing (`kill -9`, a crash, a reboot) is shown as lost when the logs are read
//! (its record is open, and no live holder or sharer record carries its id). While it
//! holds its GPU, a holder writes that it is alive every [`ALIVE_EVERY`]: a lost
//! reservation ended at the latest [`ALIVE_EVERY`] after the last such line (or its
//! start), else at that read. Only its own user's log says when it ended, so nothing
//! another user writes or deletes lengthens or shortens it.
//!
//! Each record is one line written by one `write` on a file opened for appending; a
//! damaged line (a disk that filled up in the middle of one) costs that line only: the
//! next record written starts on a line of its own, and the reader counts the damaged
//! line and goes on.

use std::collections::{HashMap, HashSet};
use std::fs::{OpenOptions, Permissions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{Holder, Ignored, LockDir, Result};

/// Every user's usage log in the lock directory is `usage-<uid>.jsonl`.
pub const USAGE_PREFIX: &str = "usage-";

/// How often a holder writes that it is still alive into its user's log: a holder that
/// dies holding its GPU is counted at most this long past its last such line.
pub const ALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

/// The latest a reservation that started at `start`, whose holder last said it was
/// alive at `alive` and then died holding its GPU, can have ended, as read at `now`.
pub(crate) fn lost_end(start: f64, alive: Option<f64>, now: f64) -> f64 {
    let last = alive.map_or(start, |a| a.max(start));
    (last + ALIVE_EVERY.as_secs_f64()).min(now).max(start)
}

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum UsageEvent {
    /// A lock was granted.
    Start {
        /// The record's id (also in the holder's record while it is held).
        id: String,
        /// Who: the user...
        user: String,
        /// ...on which host...
        host: String,
        /// ...as which process.
        pid: u32,
        /// The GPU: its UUID, or `index N` without NVML.
        gpu: String,
        /// The bytes the holder said its job needs, when it said.
        bytes: Option<u64>,
        /// Seconds since the Unix epoch.
        time: f64,
        /// The job's command line.
        command: Vec<String>,
        /// For a job sharing the GPU by memory budget (`bytes`), the GPU's memory: its
        /// use counts as `bytes / share_of` of the GPU.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        share_of: Option<u64>,
    },
    /// It ended.
    End {
        /// The id of its `Start`.
        id: String,
        /// Seconds since the Unix epoch.
        time: f64,
        /// The job's exit status (128 + a signal's number when killed), when known.
        status: Option<i32>,
        /// The holder died holding it; `time` is the latest it can have ended.
        #[serde(default)]
        lost: bool,
    },
    /// Its holder was alive and still held the GPU (written every [`ALIVE_EVERY`]).
    Alive {
        /// The id of its `Start`.
        id: String,
        /// Seconds since the Unix epoch.
        time: f64,
    },
    /// What the log adds up to before this line: written by the log's owner every so
    /// often (see [`LockDir::summarize_own_usage`]), so that a reader that has not read
    /// the log before starts at a summary instead of its first line. A summary counts
    /// only for the log's owner, and only where it says it starts (`upto`): one written
    /// after another record slipped in is not believed. Two kinds: the fair share's
    /// decayed sums (`half_life` and `state`), and `usage`'s totals (`totals`, with
    /// `half_life` 0 and `state` null).
    Summary {
        /// The byte offset of this line in the log.
        upto: u64,
        /// The half-life, in seconds, its sums are decayed with: a reader under
        /// another half-life reads the records instead.
        half_life: f64,
        /// The sums and the reservations still open.
        state: serde_json::Value,
        /// What `usage` adds up: the log's reservations that ended before this line,
        /// summed per user and per GPU; those still open; when it was written; where
        /// the log's previous such summary is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        totals: Option<serde_json::Value>,
    },
}

/// [`UsageEvent::Start`] as written: the same line, borrowing the holder's fields
/// instead of copying them (the start record is written at every lock).
#[derive(Serialize)]
#[serde(tag = "event", rename = "start")]
struct StartLine<'a> {
    id: &'a str,
    user: &'a str,
    host: &'a str,
    pid: u32,
    gpu: &'a str,
    bytes: Option<u64>,
    time: f64,
    command: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    share_of: Option<u64>,
}

/// One reservation of one GPU, as the log tells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// The record's id.
    pub id: String,
    /// Who: the user...
    pub user: String,
    /// ...on which host...
    pub host: String,
    /// ...as which process.
    pub pid: u32,
    /// The GPU.
    pub gpu: String,
    /// Bytes reserved, when said.
    pub bytes: Option<u64>,
    /// The job's command line.
    pub command: Vec<String>,
    /// A sharer's GPU memory (see [`UsageEvent::Start`]); `None` for a whole GPU.
    pub share_of: Option<u64>,
    /// Start, in seconds since the Unix epoch (`since_unix`, as every record names its
    /// start).
    pub since_unix: f64,
    /// End, in seconds since the Unix epoch; `None` while it is held.
    pub ended_unix: Option<f64>,
    /// The job's exit status, when known.
    pub status: Option<i32>,
    /// The holder died holding it (see [`UsageEvent::End`]).
    pub lost: bool,
    /// The last time its holder wrote that it was alive ([`UsageEvent::Alive`]).
    pub alive: Option<f64>,
}

impl Usage {
    /// Seconds it lasted (until `now` while held).
    pub fn seconds(&self, now: f64) -> f64 {
        (self.ended_unix.unwrap_or(now) - self.since_unix).max(0.0)
    }
}

/// Every user's log, read whole and merged.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct UsageLog {
    /// Every reservation, in the order they started.
    pub records: Vec<Usage>,
    /// Lines that could not be read (with their file and line numbers), skipped.
    pub skipped: Vec<String>,
    /// Logs and records not believed: a log owned by another uid than its name says,
    /// or a record naming another user than its log's owner.
    pub ignored: Vec<Ignored>,
}

use crate::file::OwnLog;

use tt_device::now_unix;

/// A new record's id: host, PID namespace, pid, GPU and the nanosecond it started.
pub(crate) fn new_id(holder: &Holder) -> String {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}/{}/{}/{}/{ns}",
        holder.who.host,
        holder.who.pid_ns.unwrap_or(0),
        holder.who.pid,
        holder.gpu
    )
}

/// Logs read per user: the plain name and the ones beside names others planted.
pub(crate) const MAX_LOGS: usize = 4;

/// Sorts the names of `uid`'s usage logs in the order readers take them: its plain
/// name first, then by name (readers read the first [`MAX_LOGS`] it owns).
fn reading_order(uid: u32, names: &mut [String]) {
    let plain = format!("{USAGE_PREFIX}{uid}.jsonl");
    names.sort_by(|a, b| (*a != plain, a).cmp(&(*b != plain, b)));
}

/// A usage log to read: its path and the uid it is for.
pub(crate) type LogFile = (std::path::PathBuf, u32);

impl LockDir {
    /// The usage log of the user `uid`: `usage-<uid>.jsonl` in the directory.
    pub fn usage_log_path(&self, uid: u32) -> std::path::PathBuf {
        self.path().join(format!("{USAGE_PREFIX}{uid}.jsonl"))
    }

    /// This user's log.
    pub(crate) fn own_log_path(&self) -> std::path::PathBuf {
        self.usage_log_path(crate::owner::euid())
    }

    /// Records the start of `holder`'s use of its GPU (`share_of`: the GPU's memory, for
    /// a sharer).
    pub(crate) fn record_start(&self, holder: &Holder, id: &str, share_of: Option<u64>) {
        // Cut as the holder's record is: a line past MAX_LINE would end the log's reading.
        let holder = holder.fitted();
        self.record(&StartLine {
            id,
            user: &holder.who.user,
            host: &holder.who.host,
            pid: holder.who.pid,
            gpu: &holder.gpu,
            bytes: holder.who.reserved.map(|b| b.0),
            time: now_unix(),
            command: &holder.who.command,
            share_of,
        });
    }

    /// Every user's usage log, merged: every reservation of a GPU in this directory.
    /// A reservation is running while a live holder or sharer record carries its id;
    /// one with no end and no such record belonged to a holder that died holding its
    /// GPU, and is shown lost (see the module's documentation). Nothing is written.
    pub fn usage(&self) -> Result<UsageLog> {
        let mut log = UsageLog::default();
        let (logs, ignored) = self.usage_logs()?;
        log.ignored = ignored;
        for (path, uid) in logs {
            read(&path, uid, &mut log)?;
        }
        log.records
            .sort_by(|a, b| a.since_unix.total_cmp(&b.since_unix));
        let live = self.live_usage_ids()?;
        end_lost(&mut log.records, &live, now_unix());
        Ok(log)
    }

    /// The usage logs to read, each with the uid it is for: every `usage-<uid>*.jsonl`,
    /// but at most [`MAX_LOGS`] of those each uid owns (its plain name
    /// first, then by name; the others are reported, not read). A file under a log's
    /// name that its uid does not own is listed, to be reported by its reading.
    pub(crate) fn usage_logs(&self) -> Result<(Vec<LogFile>, Vec<Ignored>)> {
        let mut by_uid: HashMap<u32, Vec<String>> = HashMap::new();
        for name in self.names()? {
            let Some(name) = name.to_str() else { continue };
            if let Some(uid) = log_uid(name) {
                by_uid.entry(uid).or_default().push(name.to_owned());
            }
        }
        let mut logs = Vec::new();
        let mut ignored = Vec::new();
        for (uid, mut names) in by_uid {
            reading_order(uid, &mut names);
            let mut owned = 0;
            for name in names {
                let path = self.path().join(&name);
                let owner = std::fs::symlink_metadata(&path).ok().map(|m| m.uid());
                if owner == Some(uid) {
                    owned += 1;
                    if owned > MAX_LOGS {
                        ignored.push(Ignored::because(
                            &path,
                            uid,
                            &crate::owner::name_of_uid(uid),
                            format!("more than {} usage logs of one user: not read", MAX_LOGS),
                        ));
                        continue;
                    }
                }
                logs.push((path, uid));
            }
        }
        Ok((logs, ignored))
    }

    /// The usage ids of the live, believed holder and sharer records, each with the
    /// user whose record carries it: an id counts only for its own user's reservations
    /// (another user's record copying it keeps nothing of theirs running).
    pub(crate) fn live_usage_ids(&self) -> Result<HashSet<(String, String)>> {
        let names = self.names()?;
        let (held, _) = crate::record::live(self.path(), names.iter().cloned(), "held-");
        let (shared, _) = crate::record::live(self.path(), names, "share-");
        Ok(held
            .into_iter()
            .chain(shared)
            .filter_map(|f| f.holder.usage.map(|id| (f.holder.who.user, id)))
            .collect())
    }
}

/// Ends each reservation of `records` whose holder died holding its GPU (no end
/// recorded, and no live record of `live` carries its id) at the latest it can have
/// ended ([`lost_end`]), and marks it lost.
pub(crate) fn end_lost(records: &mut [Usage], live: &HashSet<(String, String)>, now: f64) {
    for r in records {
        if r.ended_unix.is_none() && !live.contains(&(r.user.clone(), r.id.clone())) {
            r.ended_unix = Some(lost_end(r.since_unix, r.alive, now));
            r.lost = true;
        }
    }
}

/// The uid whose log a file name is: `usage-<uid>.jsonl`, or `usage-<uid>.<k>.jsonl`
/// (the same user's log beside a file someone else planted under the first name).
pub(crate) fn log_uid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(USAGE_PREFIX)?.strip_suffix(".jsonl")?;
    let (uid, k) = rest.split_once('.').unwrap_or((rest, "1"));
    (k.bytes().all(|b| b.is_ascii_digit()) && !k.is_empty())
        .then(|| uid.parse().ok())
        .flatten()
}

/// This user's log in `dir`: `usage-<uid>.jsonl`, or, when another user planted a
/// file under that name first (a FIFO, a file of their own), a log of this user's own
/// beside it, `usage-<uid>.<k>.jsonl`: the first such file this user already owns, else
/// a new one under a number nobody can guess (a planted file can take a name only
/// before it is chosen), with a warning that names the planted file. Readers find every
/// one of these names, and believe each only when this user owns it.
pub(crate) fn own_log(dir: &Path, uid: u32) -> std::io::Result<OwnLog> {
    let first = dir.join(format!("{USAGE_PREFIX}{uid}.jsonl"));
    let planted = match open_log(&first) {
        Ok(log) => return Ok(log),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => e,
        Err(e) => return Err(e),
    };
    let beside = |path: &Path| {
        tracing::warn!(
            "the GPU usage log {}: {planted}; recording in {} instead",
            first.display(),
            path.display()
        );
    };
    // A log of this user's own made beside an earlier planted file, in the order the
    // readers take them ([`reading_order`]): the one written is among those read.
    let mut own: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.metadata().is_ok_and(|m| m.is_file() && m.uid() == uid))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| log_uid(name) == Some(uid))
        .collect();
    reading_order(uid, &mut own);
    for name in own {
        let path = dir.join(name);
        if let Ok(log) = open_log(&path) {
            beside(&path);
            return Ok(log);
        }
    }
    for _ in 0..8 {
        let path = dir.join(format!("{USAGE_PREFIX}{uid}.{}.jsonl", unguessable()));
        if let Ok(log) = open_log(&path) {
            beside(&path);
            return Ok(log);
        }
    }
    Err(planted)
}

/// A number nobody can guess in advance: the standard library's randomly keyed hash
/// (seeded from the system's randomness) of the time and this process.
fn unguessable() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// `event` as one line, in one `write` (a record is far below what one write of an
/// appending file takes whole), after a newline when the log was left cut short.
pub(crate) fn write_line(log: &OwnLog, event: &impl Serialize) -> std::io::Result<usize> {
    let mut line = Vec::with_capacity(256);
    serde_json::to_writer(&mut line, event).map_err(std::io::Error::other)?;
    line.push(b'\n');
    write_bytes(log, &line).map(|()| line.len())
}

/// Appends `line` (a record and its newline) to `log` in one write, after a newline
/// when this process's last write there was cut short.
fn write_bytes(log: &OwnLog, line: &[u8]) -> std::io::Result<()> {
    let cut = log.cut.load(Ordering::Relaxed);
    let line = if cut {
        std::borrow::Cow::Owned([b"\n", line].concat())
    } else {
        std::borrow::Cow::Borrowed(line)
    };
    let written = (&log.file).write(&line);
    let whole = matches!(written, Ok(n) if n == line.len());
    log.cut.store(!whole, Ordering::Relaxed);
    match written {
        Ok(n) if n != line.len() => Err(std::io::Error::other(format!(
            "wrote {n} of the record's {} bytes",
            line.len()
        ))),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
fn append(path: &Path, event: &UsageEvent) -> std::io::Result<()> {
    write_line(&open_log(path)?, event).map(drop)
}

/// An open refused (another user's file that this user may not write, a name the
/// kernel will not let us follow) as the "not this user's" kind that [`own_log`] steps
/// around.
fn not_own(e: std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(libc::EACCES | libc::EPERM | libc::ELOOP | libc::ENXIO) => {
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, e)
        }
        _ => e,
    }
}

/// This user's log, opened for appending; created mode 0644 whatever the umask.
/// Refused when it is not a regular file of this user's (another user who made a file
/// of that name first cannot make us write into their file, or have us believe it).
fn open_log(path: &Path) -> std::io::Result<OwnLog> {
    let open = |create: bool| {
        OpenOptions::new()
            .read(true) // to see whether the last record was cut short
            .append(true)
            .create_new(create)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
    };
    // Without O_CREAT first: fs.protected_regular refuses O_CREAT on another user's
    // file in a sticky directory. A FIFO or another user's file is refused after
    // opening (O_NONBLOCK: a FIFO never blocks the open).
    let file = match open(false) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match open(true) {
            Ok(f) => {
                f.set_permissions(Permissions::from_mode(0o644))?;
                f
            }
            // Another process of this user created it meanwhile: that one is the log.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => open(false)?,
            Err(e) => return Err(e),
        },
        Err(e) => return Err(not_own(e)),
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() || meta.uid() != crate::owner::euid() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "it is {} owned by uid {} ({}), not this user's own log: its owner or \
                 root must remove it",
                if meta.file_type().is_file() {
                    "a file"
                } else {
                    "not a regular file"
                },
                meta.uid(),
                crate::owner::name_of_uid(meta.uid())
            ),
        ));
    }
    let mut last = [0u8; 1];
    let cut = meta.len() > 0 && file.read_at(&mut last, meta.len() - 1).is_ok() && last[0] != b'\n';
    Ok(OwnLog {
        file,
        path: path.to_owned(),
        checked: AtomicBool::new(false),
        cut: AtomicBool::new(cut),
    })
}

/// The longest line a usage log is read through: a record is a few hundred bytes, a
/// long command line a few KiB.
pub(crate) const MAX_LINE: usize = 64 * 1024;

/// The most records read from one user's log (about 4 GB of records).
const MAX_RECORDS: usize = 16_000_000;

/// Reads the log of `uid` at `path` into `log`: starts matched with their ends (in
/// this log only: nobody closes another user's reservation), damaged lines skipped
/// and counted, a log or record not its owner's ignored.
fn read(path: &Path, uid: u32, log: &mut UsageLog) -> Result<()> {
    let mut state = Tailed::<Records>::default();
    read_more(path, uid, &mut state, false)?;
    log.records.append(&mut state.sink.log.records);
    log.skipped.append(&mut state.sink.log.skipped);
    log.ignored.append(&mut state.sink.log.ignored);
    Ok(())
}

/// What a log's lines are read into ([`read_more`]): each start and end, each
/// damaged line, each record not believed. Its times are already bounded (see
/// [`TIME_SLACK`]).
pub(crate) trait Sink {
    /// A reservation started.
    fn start(&mut self, record: Usage);
    /// The reservation `id` of this log ended at `time` (no earlier than its start).
    fn end(&mut self, id: &str, time: f64, status: Option<i32>, lost: bool);
    /// The holder of the reservation `id` of this log was alive at `time`.
    fn alive(&mut self, id: &str, time: f64);
    /// A line that could not be read, or the reason the rest of the log is not read.
    fn skipped(&mut self, why: String);
    /// A log or record not believed.
    fn ignored(&mut self, why: Ignored);
    /// Everything read is forgotten: the log is another file now.
    fn reset(&mut self);
    /// A summary of everything before it ([`UsageEvent::Summary`]), whose users must
    /// all pass `believed` (the log's owner): taken in place of what was read, or
    /// refused (`false`: read on as if it were not there). Only a reader that folds the
    /// log takes one.
    fn summary(&mut self, summary: SummaryLine, believed: &dyn Fn(&str) -> bool) -> bool {
        let _ = (summary, believed);
        false
    }
}

/// A summary line as read ([`UsageEvent::Summary`]), where it says it is.
#[derive(Debug)]
pub(crate) struct SummaryLine {
    /// Its byte offset in the log.
    pub(crate) at: u64,
    /// The fair share's half-life (0 in a summary of totals only).
    pub(crate) half_life: f64,
    /// The fair share's sums.
    pub(crate) state: serde_json::Value,
    /// `usage`'s totals.
    pub(crate) totals: Option<serde_json::Value>,
}

/// A log as read so far by a reader that keeps it, reading only what was appended
/// since ([`read_more`]; logs only grow, a record per line), into its sink.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Tailed<S> {
    /// The file read (device and inode): another file under the name is read anew.
    file: (u64, u64),
    /// Bytes read, through the last whole line.
    offset: u64,
    /// Lines read.
    lines: usize,
    /// Reading stopped for good (an over-long line, too many records).
    stopped: bool,
    /// Where the last summary taken starts (0 with none).
    #[serde(default)]
    summary_at: u64,
    /// The log's length when it was last looked at.
    #[serde(default)]
    seen_len: u64,
    /// Not read: more than [`SUMMARY_SEARCH`] bytes of it lie past its last summary
    /// ([`Tailed::from_last_summary`]).
    #[serde(default)]
    unread: bool,
    /// What was read.
    pub(crate) sink: S,
}

impl<S: Sink> Tailed<S> {
    /// Bytes read so far.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The file read (device and inode), and its length when it was last looked at.
    pub(crate) fn file_and_len(&self) -> ((u64, u64), u64) {
        (self.file, self.seen_len)
    }

    /// Not read yet: the log is the file `file`, of `len` bytes.
    pub(crate) fn seen(&mut self, file: (u64, u64), len: u64) {
        self.file = file;
        self.seen_len = len;
    }

    /// Read through the summary at byte `at`, of `len` bytes (without its newline),
    /// which the sink took: the reading goes on after its newline.
    pub(crate) fn at_summary(&mut self, at: u64, len: u64) {
        self.offset = at + len + 1;
        self.summary_at = at;
        self.lines = 1;
    }

    /// Not to be read ([`Tailed::unread`]).
    pub(crate) fn set_unread(&mut self) {
        self.unread = true;
    }

    /// Bytes read since the last summary taken (all of them with none).
    pub(crate) fn since_summary(&self) -> u64 {
        self.offset - self.summary_at
    }

    /// Reading stopped for good.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }

    /// Not read: its owner wrote more than [`SUMMARY_SEARCH`] bytes past their last
    /// summary ([`Tailed::from_last_summary`]), or a line that stopped the reading.
    pub(crate) fn unread(&self) -> bool {
        self.unread || self.stopped
    }

    /// Why the log at `path` is not read ([`Tailed::unread`]), as the views say it.
    pub(crate) fn why_unread(&self, path: &Path) -> String {
        let what = if self.stopped {
            format!(
                "a line of it longer than {} KiB or past {MAX_RECORDS} records",
                MAX_LINE >> 10
            )
        } else {
            format!(
                "more than {} MiB of it past its last summary",
                SUMMARY_SEARCH >> 20
            )
        };
        format!(
            "usage log {} not read: {what}; counted as the heaviest user until their own \
             next request summarizes it",
            path.display()
        )
    }

    /// Whether a reader that holds this reading of the log reads on from it, now that
    /// the log is the file `file` of `len` bytes, and holds what a reader new to the log
    /// ([`Tailed::from_last_summary`]) would: the same file, grown, with its last summary
    /// taken still among its last [`SUMMARY_SEARCH`] bytes (a log not read, or whose
    /// reading stopped, only while it has not changed since). Otherwise the reader
    /// starts anew from the last summary, as a new reader does.
    pub(crate) fn reads_on(&self, file: (u64, u64), len: u64) -> bool {
        self.file == file
            && len >= self.offset
            && if self.unread() {
                len == self.seen_len
            } else {
                len - self.summary_at <= SUMMARY_SEARCH
            }
    }

    /// A log not read yet, into `sink`.
    pub(crate) fn new(sink: S) -> Tailed<S> {
        Tailed {
            file: (0, 0),
            offset: 0,
            lines: 0,
            stopped: false,
            summary_at: 0,
            seen_len: 0,
            unread: false,
            sink,
        }
    }

    /// A log not read yet, into `sink`, to be read from the last summary among its last
    /// [`SUMMARY_SEARCH`] bytes that the sink takes (from its first line when there is
    /// none and the log is no longer than that): what [`read_more`] then reads is what a
    /// reader that read the log from its start holds after it, whatever the log holds
    /// before. A longer log without one is not read at all ([`Tailed::unread`]): its
    /// owner, who writes a summary at least every [`SUMMARY_EVERY`] bytes
    /// while they reserve, wrote more than that unsummarized, and what that costs is
    /// charged to them, not to every reader's time. (A line there that begins as a
    /// summary and cannot be read goes to the sink's `skipped`, as `read_more` sends it:
    /// for the tally's sink, nothing.)
    pub(crate) fn from_last_summary(path: &Path, sink: S) -> Tailed<S> {
        let mut tailed = Tailed::new(sink);
        let Some(tail) = summary_lines(path) else {
            return tailed;
        };
        tailed.seen(tail.file, tail.len);
        let now = now_unix();
        for (at, line) in tail.summaries {
            // Taken as `read_more` takes it, which leaves a reader past its newline.
            if take_line(&line, path, tail.owner, (0, at), &mut tailed.sink, now) {
                tailed.at_summary(at, line.len() as u64);
                return tailed;
            }
        }
        tailed.unread = tail.len > SUMMARY_SEARCH;
        tailed
    }

    fn reset(&mut self, file: (u64, u64)) {
        self.file = file;
        self.offset = 0;
        self.lines = 0;
        self.stopped = false;
        self.summary_at = 0;
        self.unread = false;
        self.sink.reset();
    }
}

/// Every record of a log, as `usage` lists them.
#[derive(Debug, Default)]
pub(crate) struct Records {
    log: UsageLog,
    /// Where each start's record is in `log.records`.
    by_id: HashMap<String, usize>,
}

#[cfg(test)]
impl Records {
    /// The records read.
    pub(crate) fn into_records(self) -> Vec<Usage> {
        self.log.records
    }
}

impl Sink for Records {
    fn start(&mut self, record: Usage) {
        self.by_id.insert(record.id.clone(), self.log.records.len());
        self.log.records.push(record);
    }

    fn end(&mut self, id: &str, time: f64, status: Option<i32>, lost: bool) {
        if let Some(r) = self.by_id.get(id).map(|i| &mut self.log.records[*i]) {
            if r.ended_unix.is_none() {
                r.ended_unix = Some(time.max(r.since_unix));
                r.status = status;
                r.lost = lost;
            }
        }
    }

    fn alive(&mut self, id: &str, time: f64) {
        if let Some(r) = self.by_id.get(id).map(|i| &mut self.log.records[*i]) {
            if r.ended_unix.is_none() {
                r.alive = Some(r.alive.map_or(time, |a| a.max(time)));
            }
        }
    }

    fn skipped(&mut self, why: String) {
        self.log.skipped.push(why);
    }

    fn ignored(&mut self, why: Ignored) {
        self.log.ignored.push(why);
    }

    fn reset(&mut self) {
        *self = Records::default();
    }
}

/// Reads on in the log of `uid` at `path` from where `state` stopped (from its start
/// when it is another file now). `whole_lines`: a last line without its newline (being
/// written) is left for the next read, rather than read as damaged.
pub(crate) fn read_more<S: Sink>(
    path: &Path,
    uid: u32,
    state: &mut Tailed<S>,
    whole_lines: bool,
) -> Result<()> {
    use std::io::{Seek, SeekFrom};
    let Some((file, meta)) = crate::file::open_to_read(path) else {
        // Gone since, or something else under a log's name (a FIFO, a symbolic link):
        // not a log, and reported when it is there.
        state.reset((0, 0));
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            state.sink.ignored(Ignored::because(
                path,
                meta.uid(),
                &crate::owner::name_of_uid(uid),
                "not a regular file under a usage log's name: not read".into(),
            ));
        }
        return Ok(());
    };
    let owner = crate::owner::name_of_uid(uid);
    if state.file != (meta.dev(), meta.ino()) || meta.len() < state.offset {
        state.reset((meta.dev(), meta.ino()));
    }
    if let Err(why) = crate::owner::check(path, meta.uid(), &owner) {
        state.sink.reset();
        state.sink.ignored(why);
        state.stopped = true;
        return Ok(());
    }
    state.seen_len = meta.len();
    if state.unread() || meta.len() == state.offset {
        return Ok(());
    }
    let io = |e: std::io::Error| crate::Error::Io {
        op: "reading the usage log",
        path: path.to_owned(),
        cause: e,
    };
    (&file).seek(SeekFrom::Start(state.offset)).map_err(io)?;
    // Streamed a line at a time, each line at most MAX_LINE bytes: a log grown huge
    // (`truncate -s 1T`) costs its owner's records past the first over-long line, never
    // a reader's memory or patience.
    let now = now_unix();
    let mut reader = std::io::BufReader::with_capacity(64 * 1024, &file);
    let mut line = Vec::with_capacity(512);
    loop {
        let n = state.lines;
        line.clear();
        let read = std::io::BufRead::read_until(
            &mut std::io::Read::take(&mut reader, MAX_LINE as u64 + 1),
            b'\n',
            &mut line,
        )
        .map_err(io)?;
        if read == 0 || (whole_lines && line.last() != Some(&b'\n') && line.len() <= MAX_LINE) {
            break;
        }
        state.offset += read as u64;
        state.lines += 1;
        if line.len() > MAX_LINE || n >= MAX_RECORDS {
            let why = format!(
                "{}: line {}: {}; the rest of this log is not read",
                path.display(),
                n + 1,
                if n >= MAX_RECORDS {
                    format!("more than {MAX_RECORDS} records")
                } else {
                    format!("longer than {MAX_LINE} bytes")
                }
            );
            tracing::warn!("skipping a damaged usage log: {why}");
            state.sink.skipped(why);
            state.stopped = true;
            break;
        }
        let line = line.strip_suffix(b"\n").unwrap_or(&line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let at = state.offset - read as u64;
        if take_line(line, path, meta.uid(), (n, at), &mut state.sink, now) {
            // As a reader that started at this summary counts.
            state.lines = 1;
            state.summary_at = at;
        }
    }
    Ok(())
}

/// Bytes of a log past its last summary after which its owner writes another: a
/// reader new to the log reads about this much of it.
pub(crate) const SUMMARY_EVERY: u64 = 128 << 10;

/// How far from its end a log is searched for its last summary
/// ([`Tailed::from_last_summary`]): its owner writes one every
/// [`SUMMARY_EVERY`] bytes while they reserve.
pub(crate) const SUMMARY_SEARCH: u64 = 1 << 20;

/// A log's end as searched for its last summary ([`summary_lines`]).
pub(crate) struct Tail {
    /// The file (device and inode).
    pub(crate) file: (u64, u64),
    /// Its owner.
    pub(crate) owner: u32,
    /// Its length.
    pub(crate) len: u64,
    /// The whole lines among its last [`SUMMARY_SEARCH`] bytes that begin as a summary
    /// does, the last first: each one's offset and its text (without its newline).
    pub(crate) summaries: Vec<(u64, Vec<u8>)>,
}

/// The log at `path`'s end, searched for summaries; `None` when it is not a regular
/// file that can be read.
pub(crate) fn summary_lines(path: &Path) -> Option<Tail> {
    const MARK: &[u8] = b"{\"event\":\"summary\"";
    let (file, meta) = crate::file::open_to_read(path)?;
    let from = meta.len().saturating_sub(SUMMARY_SEARCH);
    // With the byte before, which says whether a line begins where the search does.
    let before = from.min(1);
    let mut tail = vec![0u8; usize::try_from(meta.len() - from + before).ok()?];
    file.read_exact_at(&mut tail, from - before).ok()?;
    let starts_line = |i: usize| (i == 0 && from == 0) || (i > 0 && tail[i - 1] == b'\n');
    let before = before as usize;
    let summaries = memchr::memmem::rfind_iter(&tail[before..], MARK)
        .map(|i| i + before)
        .filter(|&i| starts_line(i))
        // A whole line only: the reading goes on after its newline.
        .filter_map(|i| {
            let len = memchr::memchr(b'\n', &tail[i..])?;
            Some((from - before as u64 + i as u64, tail[i..i + len].to_vec()))
        })
        .collect();
    Some(Tail {
        file: (meta.dev(), meta.ino()),
        owner: meta.uid(),
        len: meta.len(),
        summaries,
    })
}

/// Appends to this user's log at `path` a summary of its first `upto` bytes: the fair
/// share's `state`, decayed with `half_life` seconds, or `usage`'s `totals`; when the
/// log is still that long and the line fits what readers read: whether it was written.
pub(crate) fn append_summary(
    path: &Path,
    upto: u64,
    half_life: f64,
    state: serde_json::Value,
    totals: Option<serde_json::Value>,
) -> bool {
    let event = UsageEvent::Summary {
        upto,
        half_life,
        state,
        totals,
    };
    let Ok(mut line) = serde_json::to_vec(&event) else {
        return false;
    };
    line.push(b'\n');
    let Ok(log) = open_log(path) else {
        return false;
    };
    if line.len() > MAX_LINE || log.file.metadata().map_or(true, |m| m.len() != upto) {
        return false;
    }
    match write_bytes(&log, &line) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("cannot summarize the usage log {}: {e}", path.display());
            false
        }
    }
}

/// A record's times are read into `[0, now + TIME_SLACK]` (an end no earlier than its
/// start): a log's owner writes them, and whatever they write, every sum and ratio of
/// them stays finite and no record says it lasted longer than the epoch.
pub(crate) const TIME_SLACK: f64 = 60.0;

/// One line of a log into `sink`: a start recorded, an end matched with its start, a
/// damaged line counted, a record not its log's owner's ignored; times bounded (see
/// [`TIME_SLACK`]) at `now`.
///
/// `(n, at)`: the line's number and its byte offset. Returns whether it was a summary
/// the sink took.
fn take_line(
    line: &[u8],
    path: &Path,
    owner_uid: u32,
    (n, at): (usize, u64),
    sink: &mut impl Sink,
    now: f64,
) -> bool {
    let latest = now + TIME_SLACK;
    match serde_json::from_slice::<UsageEvent>(line) {
        Ok(UsageEvent::Start {
            id,
            user,
            host,
            pid,
            gpu,
            bytes,
            time,
            command,
            share_of,
        }) => {
            if let Err(why) = crate::owner::check(path, owner_uid, &user) {
                sink.ignored(why);
                return false;
            }
            sink.start(Usage {
                id,
                user,
                host,
                pid,
                gpu,
                bytes,
                command,
                share_of,
                since_unix: time.clamp(0.0, latest),
                ended_unix: None,
                status: None,
                lost: false,
                alive: None,
            });
        }
        Ok(UsageEvent::End {
            id,
            time,
            status,
            lost,
        }) => sink.end(&id, time.clamp(0.0, latest), status, lost),
        Ok(UsageEvent::Alive { id, time }) => sink.alive(&id, time.clamp(0.0, latest)),
        Ok(UsageEvent::Summary {
            upto,
            half_life,
            state,
            totals,
        }) => {
            let line = SummaryLine {
                at,
                half_life,
                state,
                totals,
            };
            return upto == at
                && sink.summary(line, &|user| {
                    crate::owner::check(path, owner_uid, user).is_ok()
                });
        }
        Err(e) => {
            let why = format!("{}: line {}: {e}", path.display(), n + 1);
            tracing::warn!("skipping a damaged usage record: {why}");
            sink.skipped(why);
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_line_written_is_the_start_record_read() {
        let command = vec!["python".to_owned(), "train.py".to_owned()];
        let line = StartLine {
            id: "h/0/7/GPU-1/5",
            user: "ada",
            host: "h",
            pid: 7,
            gpu: "GPU-1",
            bytes: Some(1 << 30),
            time: 100.5,
            command: &command,
            share_of: None,
        };
        let read: UsageEvent = serde_json::from_slice(&serde_json::to_vec(&line).unwrap()).unwrap();
        let record = UsageEvent::Start {
            id: line.id.into(),
            user: "ada".into(),
            host: "h".into(),
            pid: 7,
            gpu: "GPU-1".into(),
            bytes: Some(1 << 30),
            time: 100.5,
            command: command.clone(),
            share_of: None,
        };
        assert_eq!(read, record);
        // Byte for byte the line the record itself writes.
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            serde_json::to_string(&record).unwrap()
        );
    }

    #[test]
    fn a_usage_log_with_an_endless_line_is_read_to_its_cap_and_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = crate::LockDir::open(tmp.path().join("locks")).unwrap();
        let uid = crate::owner::euid();
        let path = dir.usage_log_path(uid);
        let start = UsageEvent::Start {
            id: "a".into(),
            user: crate::owner::name_of_uid(uid),
            host: "h".into(),
            pid: 1,
            gpu: "GPU-1".into(),
            bytes: None,
            time: 100.0,
            command: vec![],
            share_of: None,
        };
        append(&path, &start).unwrap();
        // `truncate -s 1T`: a terabyte of zeros after the first record, no newline.
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(1 << 40).unwrap();
        let usage = dir.usage().unwrap();
        assert_eq!(usage.records.len(), 1, "{usage:?}");
        assert_eq!(usage.skipped.len(), 1, "{usage:?}");
        assert!(
            usage.skipped[0].contains("line 2: longer than 65536 bytes"),
            "{usage:?}"
        );
    }

    #[test]
    fn processes_of_one_user_creating_its_log_at_once_all_get_it() {
        for _ in 0..20 {
            let tmp = tempfile::tempdir().unwrap();
            let barrier = std::sync::Barrier::new(8);
            let opened: Vec<bool> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            own_log(tmp.path(), crate::owner::euid()).is_ok()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(opened.iter().all(|&ok| ok), "{opened:?}");
        }
    }

    #[test]
    fn times_a_log_says_are_read_within_the_epoch_and_now() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let path = tmp.path().join(format!("{USAGE_PREFIX}{uid}.jsonl"));
        let user = crate::owner::name_of_uid(uid);
        for (id, start, end) in [("a", -1e300, 1e300), ("b", 1e300, -1e300), ("c", 5.0, 1.0)] {
            let line = format!(
                "{{\"event\":\"start\",\"id\":\"{id}\",\"user\":\"{user}\",\"host\":\"h\",\
                 \"pid\":1,\"gpu\":\"g\",\"bytes\":null,\"time\":{start:e},\"command\":[]}}\n\
                 {{\"event\":\"end\",\"id\":\"{id}\",\"time\":{end:e},\"status\":0}}\n"
            );
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap()
                .write_all(line.as_bytes())
                .unwrap();
        }
        let mut log = UsageLog::default();
        read(&path, uid, &mut log).unwrap();
        let now = now_unix();
        assert_eq!(log.records.len(), 3, "{log:?}");
        for r in &log.records {
            let end = r.ended_unix.unwrap();
            assert!(
                (0.0..=now + TIME_SLACK + 1.0).contains(&r.since_unix) && end >= r.since_unix,
                "{r:?}"
            );
            assert!(end <= now + TIME_SLACK + 1.0, "{r:?}");
        }
        assert_eq!(
            (log.records[2].since_unix, log.records[2].ended_unix),
            (5.0, Some(5.0))
        );
        let total: f64 = log.records.iter().map(|r| r.seconds(now)).sum();
        assert!(
            total.is_finite() && total <= now + TIME_SLACK + 1.0,
            "{total}"
        );
    }

    #[test]
    fn records_read_back_and_a_damaged_line_is_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = crate::owner::euid();
        let path = tmp.path().join(format!("{USAGE_PREFIX}{uid}.jsonl"));
        let start = |id: &str, gpu: &str, time: f64| UsageEvent::Start {
            id: id.into(),
            user: crate::owner::name_of_uid(uid),
            host: "h".into(),
            pid: 1,
            gpu: gpu.into(),
            bytes: Some(1 << 30),
            time,
            command: vec!["train".into()],
            share_of: None,
        };
        append(&path, &start("a", "GPU-1", 100.0)).unwrap();
        append(&path, &start("b", "GPU-2", 150.0)).unwrap();
        append(
            &path,
            &UsageEvent::End {
                id: "a".into(),
                time: 160.0,
                status: Some(0),
                lost: false,
            },
        )
        .unwrap();
        // A line cut short, as a full disk leaves it.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"event\":\"end\",\"id\":\"b\",\"ti")
            .unwrap();
        // A record written after it starts on a line of its own.
        append(&path, &start("c", "GPU-3", 170.0)).unwrap();
        let mut log = UsageLog::default();
        read(&path, uid, &mut log).unwrap();
        assert_eq!(log.records.len(), 3, "{log:?}");
        assert_eq!(log.records[2].id, "c");
        assert_eq!(log.records[0].ended_unix, Some(160.0));
        assert_eq!(log.records[0].status, Some(0));
        assert_eq!(log.records[0].seconds(1000.0), 60.0);
        assert_eq!(log.records[1].ended_unix, None);
        assert_eq!(log.records[1].seconds(200.0), 50.0);
        assert_eq!(log.skipped.len(), 1, "{:?}", log.skipped);
        assert!(log.skipped[0].contains("line 4"), "{:?}", log.skipped);
    }
}
