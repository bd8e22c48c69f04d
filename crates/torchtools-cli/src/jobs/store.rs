//! The records of detached jobs: `job-ID.json` in the lock directory, each written by
//! its job's user (mode 0644: every user's jobs are visible with `--all`, and only
//! their owner can change them); a record whose user is not its file's owner is ignored
//! and said, and one that cannot be read is listed as damaged. What a job's state is
//! (waiting, running, finished, lost), found from its record, its processes and the
//! GPU locks; and its log, in the user's own state directory.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tt_lock::LockDir;

use crate::exit::Exit;

/// A job's record: `job-ID.json` in the lock directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) user: String,
    pub(crate) uid: u32,
    pub(crate) host: String,
    /// The kernel's boot id when it started: another one now means the machine
    /// rebooted and the job is lost.
    pub(crate) boot_id: String,
    /// `torchtools` and its arguments, as the job runs them.
    pub(crate) command: Vec<String>,
    pub(crate) log: PathBuf,
    /// When it was started, in seconds since the Unix epoch: `since_unix` in the record,
    /// the name every record of torchtools gives its start.
    #[serde(flatten)]
    pub(crate) since: Since,
    /// The keeper (`job-run`), leader of the job's session.
    pub(crate) keeper_pid: u32,
    /// The PID namespace its pids mean something in (a container's, or the host's).
    #[serde(default)]
    pub(crate) pid_ns: Option<u64>,
    /// The job's `torchtools`, once started.
    #[serde(default)]
    pub(crate) pid: Option<u32>,
    #[serde(default)]
    pub(crate) ended_unix: Option<f64>,
    /// The exit status (128 + a signal's number when killed).
    #[serde(default)]
    pub(crate) status: Option<i32>,
    /// The jobs it starts after, however they end (`--after`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) after: Vec<String>,
    /// The jobs it starts after, only if they all succeed (`--after-ok`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) after_ok: Vec<String>,
    /// While it waits for one of those: that job's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) waiting_for: Option<String>,
    /// Why it ended without running ("job ID failed"), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cancelled: Option<String>,
    /// Its (last) run was ended by its time limit (`--time`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) timed_out: bool,
    /// Run again when it exits 75 (`--requeue`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) requeue: bool,
    /// How many times its command has started (more than once when requeued).
    #[serde(default)]
    pub(crate) runs: u32,
    /// Its place in a job array (`--array`), when it is one of its tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) array: Option<ArrayTask>,
}

/// When a job was started, in seconds since the Unix epoch.
///
/// Written as `since_unix` (the start's one name in every record: locks, tickets, jobs,
/// usage) and, for this release, also as `started_unix`, the name torchtools 0.x before
/// it wrote: a keeper of the earlier version still running a job reads the records the
/// new one writes. Read from either. The second key goes in the next release.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Since(pub(crate) f64);

/// [`Since`] as written: both names, either read.
#[derive(Serialize, Deserialize)]
struct SinceKeys {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    since_unix: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    started_unix: Option<f64>,
}

impl Serialize for Since {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        SinceKeys {
            since_unix: Some(self.0),
            started_unix: Some(self.0),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Since {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Since, D::Error> {
        let keys = SinceKeys::deserialize(deserializer)?;
        keys.since_unix
            .or(keys.started_unix)
            .map(Since)
            .ok_or_else(|| serde::de::Error::missing_field("since_unix"))
    }
}

impl Job {
    /// How an ended job ended, as one status: its exit status; 1 when it was cancelled or
    /// lost (its keeper killed, the machine rebooted).
    pub(crate) fn outcome(&self) -> i32 {
        match (self.status, &self.cancelled) {
            (Some(code), _) => code,
            _ => 1,
        }
    }

    /// A job's state, as `jobs` says it, with the run it is in when it was requeued:
    /// `running (run 2)`.
    pub(crate) fn state(&self, waiting_pids: &[u32]) -> String {
        let base = self.base_state(waiting_pids);
        match self.runs {
            0 | 1 => base,
            n => format!("{base} (run {n})"),
        }
    }

    /// [`Job::state`] without the run.
    pub(crate) fn base_state(&self, waiting_pids: &[u32]) -> String {
        if let Some(why) = &self.cancelled {
            return format!("cancelled: {why}");
        }
        if let Some(code) = self.status {
            // (A command that met its limit but exited 0 all the same finished.)
            return match self.timed_out && code != 0 {
                true => format!("timeout: {}", status_text(code)),
                false => status_text(code),
            };
        }
        if self.boot_id != tt_device::boot_id() {
            return "lost (the machine rebooted)".into();
        }
        if self.elsewhere() {
            return "started in another PID namespace".into();
        }
        if !self.alive() {
            return "lost (its keeper was killed)".into();
        }
        if let Some(other) = &self.waiting_for {
            return format!("waiting for job {other}");
        }
        match self.pid {
            Some(pid) if waiting_pids.contains(&pid) => "waiting".into(),
            Some(_) => "running".into(),
            None => "starting".into(),
        }
    }

    /// Whether the job was started in another PID namespace (a container, or the host seen
    /// from one), where its pids mean other processes than here.
    pub(crate) fn elsewhere(&self) -> bool {
        self.pid_ns.is_some() && self.pid_ns != tt_lock::own_pid_namespace()
    }

    /// Whether the job has ended: its status is recorded, or (in its own PID namespace) its
    /// keeper is gone. From another namespace only the record can say.
    pub(crate) fn ended(&self) -> bool {
        self.said_ended() || (!self.elsewhere() && !self.alive())
    }

    /// Whether the job's record alone says it ended: its status, its cancellation, or a boot
    /// since it started.
    fn said_ended(&self) -> bool {
        self.status.is_some() || self.cancelled.is_some() || self.boot_id != tt_device::boot_id()
    }

    /// Whether the job's keeper still runs: its pid is a `job-run` of this id (a pid alone
    /// could be another process's by now).
    pub(crate) fn alive(&self) -> bool {
        // Its user's (another user's process named so is not it); no start time check:
        // the id in its arguments already names this job.
        self.of_jobs_user(self.keeper_pid)
            && tt_device::procfs::cmdline(self.keeper_pid).is_some_and(|args| {
                args.windows(2)
                    .any(|w| w[0] == "job-run" && w[1] == self.id)
            })
    }

    /// Whether `pid` is a process of the job's user.
    pub(crate) fn of_jobs_user(&self, pid: u32) -> bool {
        tt_device::procfs::uid(pid) == Some(self.uid)
    }

    /// Whether `pid` can be one of the job's processes: it belongs to the job's user and
    /// started no earlier than the job (a pid is reused: an older process, or another
    /// user's, under a pid the record names is not the job's, and is never signalled).
    pub(crate) fn is_jobs(&self, pid: u32) -> bool {
        // btime is whole seconds: a process may seem to start up to a second early.
        const SLACK: f64 = 2.0;
        self.of_jobs_user(pid)
            && tt_device::procfs::started_unix(pid).is_some_and(|t| t >= self.since.0 - SLACK)
    }

    /// The GPUs a running job holds and the bytes it reserved on them: the locks whose
    /// holder is the job's torchtools.
    pub(crate) fn held_by(&self, locks: &[tt_lock::LockState]) -> (Vec<String>, Option<u64>) {
        let Some(pid) = self.pid else {
            return (Vec::new(), None);
        };
        let mut gpus = Vec::new();
        let mut bytes = None;
        for state in locks.iter().filter(|s| s.held) {
            if let Some(h) = state
                .holder
                .as_ref()
                .filter(|h| h.who.pid == pid && h.who.host == self.host)
            {
                gpus.push(h.gpu.clone());
                bytes = h.who.reserved.map(|b| b.0).or(bytes);
            }
        }
        (gpus, bytes)
    }
}

/// A task of a job array: the array's id and this task's index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct ArrayTask {
    pub(crate) id: String,
    pub(crate) index: u32,
}

/// The variable that tells an array's task its index (`--array`).
pub(crate) const ARRAY_TASK_ENV: &str = "TORCHTOOLS_ARRAY_TASK_ID";

/// The directory of job records: the lock directory itself (`TORCHTOOLS_LOCK_DIR`),
/// sticky, where only a record's owner (and the directory's owner, root on a server
/// set up well) can change or remove it. Not a subdirectory: whoever created that
/// could remove every user's records in it.
pub(crate) fn records_dir() -> Result<PathBuf> {
    records_dir_in(&LockDir::from_env()?)
}

/// [`records_dir`] of a lock directory already open.
pub(crate) fn records_dir_in(locks: &LockDir) -> Result<PathBuf> {
    Ok(locks.path().to_owned())
}

/// The most a job record's file is read (a record is a few hundred bytes).
pub(crate) const MAX_RECORD: u64 = 1 << 20;

/// What job records are named: `job-ID.json`.
pub(crate) const RECORD_PREFIX: &str = "job-";

pub(crate) fn record_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{RECORD_PREFIX}{id}.json"))
}

/// `id`, or `id-2`, `id-3`... when a file of that name is there already (an id is
/// predictable: another user may have put a file under its name first, which this
/// user could then neither replace nor remove).
pub(crate) fn free_id(records: &Path, id: &str) -> String {
    (1..)
        .map(|n| match n {
            1 => id.to_owned(),
            n => format!("{id}-{n}"),
        })
        .find(|id| fs::symlink_metadata(record_path(records, id)).is_err())
        .unwrap_or_else(|| id.to_owned())
}

/// Writes `job` atomically (a temporary file renamed over the record), readable by all.
pub(crate) fn save(dir: &Path, job: &Job) -> Result<()> {
    let path = record_path(dir, &job.id);
    let temp = dir.join(format!(".{}.{}.tmp", job.id, std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)
        .with_context(|| format!("writing {}", temp.display()))?;
    // Readable by every user whatever the umask (`jobs --all`).
    file.set_permissions(fs::Permissions::from_mode(0o644))?;
    file.write_all(&serde_json::to_vec_pretty(job)?)?;
    file.sync_all()?;
    fs::rename(&temp, &path).with_context(|| format!("placing {}", path.display()))?;
    Ok(())
}

pub(crate) fn load(path: &Path) -> Option<Job> {
    match read_record(path) {
        Record::Job(job) => Some(*job),
        _ => None,
    }
}

/// The record at `path` when it is this user's record of job `id`: what a job's own
/// processes read and write back (another user's record, or one of another id, is
/// never run nor changed).
pub(crate) fn load_own(path: &Path, id: &str) -> Option<Job> {
    load(path).filter(|j| j.uid == tt_lock::euid() && j.id == id)
}

/// What a job record file holds, as a reader finds it.
pub(crate) enum Record {
    /// A job, written by its own user.
    Job(Box<Job>),
    /// A record naming another user than its file's owner: not believed.
    Ignored(tt_lock::Ignored),
    /// Not a job record (not JSON, cut short): listed as damaged, not dropped.
    Damaged(String),
    /// Gone, a symbolic link, or not a regular file: no record.
    None,
}

/// Reads a job record: never through a symbolic link, and believed only when the user
/// and uid it names are its file's owner.
///
/// A job whose keeper is gone although its record says neither how it ended nor that
/// it was cancelled is read a second time: the keeper saves its outcome before it
/// exits, so a record read just before that save and a keeper seen gone just after it
/// would otherwise make a finished or cancelled job read as lost (`jobs wait` said
/// "lost" and exited 1 for a job cancelled at that instant).
pub(crate) fn read_record(path: &Path) -> Record {
    let first = read_record_once(path);
    match &first {
        Record::Job(job) if looks_lost(job) => {
            #[cfg(test)]
            BETWEEN_READS.with(|hook| {
                if let Some(hook) = hook.take() {
                    hook(path);
                }
            });
            read_record_once(path)
        }
        _ => first,
    }
}

/// Whether `job` would read as lost: no outcome, this boot, this PID namespace, and no
/// keeper.
fn looks_lost(job: &Job) -> bool {
    !job.said_ended() && !job.elsewhere() && !job.alive()
}

/// A test's stand-in for a keeper that saves its outcome between the two reads.
#[cfg(test)]
type BetweenReads = Box<dyn FnOnce(&Path)>;

#[cfg(test)]
thread_local! {
    static BETWEEN_READS: std::cell::Cell<Option<BetweenReads>> =
        const { std::cell::Cell::new(None) };
}

/// One reading of a record (see [`read_record`]).
fn read_record_once(path: &Path) -> Record {
    use std::os::unix::fs::MetadataExt;
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    else {
        return Record::None;
    };
    let Ok(meta) = file.metadata() else {
        return Record::None;
    };
    if !meta.file_type().is_file() {
        return Record::None;
    }
    let mut text = Vec::new();
    // A record is a few hundred bytes: a file of any size costs at most this much.
    if let Err(e) =
        std::io::Read::read_to_end(&mut std::io::Read::take(&file, MAX_RECORD + 1), &mut text)
    {
        return Record::Damaged(format!("{}: {e}", path.display()));
    }
    if text.len() as u64 > MAX_RECORD {
        return Record::Damaged(format!(
            "{}: larger than {MAX_RECORD} bytes, not a job record (only its owner can \
             remove it)",
            path.display()
        ));
    }
    let job: Job = match serde_json::from_slice(&text) {
        Ok(job) => job,
        Err(e) => return Record::Damaged(format!("{}: {e}", path.display())),
    };
    // Its id is its name: a record of one's own naming another job's id never takes
    // that job's place in `stop`, `logs`, `jobs wait` or `--after`.
    if path.file_name() != record_path(Path::new(""), &job.id).file_name() {
        return Record::Damaged(format!(
            "{}: it names job {:?}, not the job of its file name",
            path.display(),
            job.id
        ));
    }
    // The user it names must own the file (tt-lock's rule), and so must its uid.
    let owner = meta.uid();
    let believed = tt_lock::check_owner(path, owner, &job.user).and_then(|()| {
        match job.uid == owner {
            true => Ok(()),
            // Never a user name: refused, saying the uid it claims.
            false => tt_lock::check_owner(path, owner, &format!("uid {}", job.uid)),
        }
    });
    match believed {
        Ok(()) => Record::Job(Box::new(job)),
        Err(why) => Record::Ignored(why),
    }
}

/// The variable that tells a detached job's command which run it is: 1, then 2 after
/// a first requeue, ...
pub(crate) const JOB_RUN_ENV: &str = "TORCHTOOLS_JOB_RUN";

/// Marks the detached job this process runs in (its `TORCHTOOLS_JOB_ID`, this user's
/// record) as ended by its time limit; nothing outside a job.
pub(crate) fn mark_timed_out() {
    let Some(id) = std::env::var_os(crate::jobs::store::JOB_ID_ENV) else {
        return;
    };
    let id = id.to_string_lossy();
    let Ok(records) = records_dir() else {
        return;
    };
    let path = record_path(&records, &id);
    if let Some(mut job) = load_own(&path, &id) {
        job.timed_out = true;
        if let Err(e) = save(&records, &job) {
            tracing::warn!("cannot mark job {id} as timed out: {e}");
        }
    }
}

/// An ended job's state, from its exit status: "finished", "failed (3)", "killed by
/// signal 9", "preempted (75)" (`jobs` and the `--on-end` hook's TORCHTOOLS_JOB_STATE).
pub(crate) fn status_text(code: i32) -> String {
    match code {
        0 => "finished".into(),
        c if c == i32::from(crate::exit::TEMPFAIL) => format!("preempted ({c})"),
        c if c > 128 => format!("killed by signal {}", c - 128),
        c => format!("failed ({c})"),
    }
}

/// Every job's record in `records`, oldest first.
pub(crate) fn all_jobs(records: &Path) -> Result<Vec<Job>> {
    Ok(scan(records)?.jobs)
}

/// The job records of a directory as `jobs` shows them.
#[derive(Default)]
pub(crate) struct Scan {
    /// Believed records, oldest first.
    pub(crate) jobs: Vec<Job>,
    /// Records not believed.
    pub(crate) ignored: Vec<tt_lock::Ignored>,
    /// Records that cannot be read, with why.
    pub(crate) damaged: Vec<String>,
}

pub(crate) fn scan(records: &Path) -> Result<Scan> {
    let mut scan = Scan::default();
    for entry in fs::read_dir(records)
        .with_context(|| format!("reading {}", records.display()))?
        .flatten()
    {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with(RECORD_PREFIX) && name.ends_with(".json")) {
            continue;
        }
        match read_record(&entry.path()) {
            Record::Job(job) => scan.jobs.push(*job),
            Record::Ignored(why) => scan.ignored.push(why),
            Record::Damaged(why) => scan.damaged.push(why),
            Record::None => {}
        }
    }
    // An array's tasks (one start) together, by index.
    scan.jobs.sort_by(|a, b| {
        a.since.0.total_cmp(&b.since.0).then_with(|| {
            a.array
                .as_ref()
                .map(|t| t.index)
                .cmp(&b.array.as_ref().map(|t| t.index))
        })
    });
    Ok(scan)
}

/// The job `id` names: exactly, or by a unique prefix; `last`: the user's latest.
pub(crate) fn find(records: &Path, id: &str) -> Result<Job> {
    let jobs = all_jobs(records)?;
    if id == "last" {
        return jobs
            .into_iter()
            .rev()
            .find(|j| j.uid == tt_lock::euid())
            .ok_or_else(|| Exit::usage("you have no job yet".into()).into());
    }
    // Exactly the id, else a prefix; among the caller's own jobs first, so that nobody
    // else's record can make the caller's id ambiguous.
    let (mine, others): (Vec<Job>, Vec<Job>) =
        jobs.into_iter().partition(|j| j.uid == tt_lock::euid());
    let pick = |jobs: &[Job]| -> Vec<Job> {
        let exact: Vec<Job> = jobs.iter().filter(|j| j.id == id).cloned().collect();
        match exact.is_empty() {
            true => jobs
                .iter()
                .filter(|j| j.id.starts_with(id))
                .cloned()
                .collect(),
            false => exact,
        }
    };
    let mut matches = pick(&mine);
    if matches.is_empty() {
        matches = pick(&others);
    }
    match matches.len() {
        1 => Ok(matches.into_iter().next().unwrap_or_else(|| unreachable!())),
        0 => Err(Exit::usage(format!("no job {id:?}: `torchtools jobs --all` lists them")).into()),
        n => Err(Exit::usage(format!("{n} jobs start with {id:?}: give more of the id")).into()),
    }
}

/// A job that has not ended, as `metrics` counts it.
pub(crate) struct LiveJob {
    pub(crate) id: String,
    pub(crate) user: String,
    /// Waiting for jobs (`--after`) or in the GPU queue; else running.
    pub(crate) waiting: bool,
    /// The GPUs it holds, and the bytes reserved on each.
    pub(crate) gpus: Vec<String>,
    pub(crate) bytes: Option<u64>,
}

impl LiveJob {
    /// The job of `row`, when it has not ended.
    pub(crate) fn of(row: &Row) -> Option<LiveJob> {
        (!row.job.ended()).then(|| LiveJob {
            waiting: row.state.starts_with("waiting"),
            id: row.job.id.clone(),
            user: row.job.user.clone(),
            gpus: row.gpus.clone(),
            bytes: row.bytes,
        })
    }
}

/// A job as `jobs --json` shows it (and `serve`'s page): its record, its state now,
/// and the GPUs it holds now with the bytes reserved on each.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    #[serde(flatten)]
    pub(crate) job: Job,
    pub(crate) state: String,
    /// The GPUs it holds now, and the bytes reserved on each.
    pub(crate) gpus: Vec<String>,
    pub(crate) bytes: Option<u64>,
}

/// `jobs` as rows, given the pids waiting in the queue and the GPUs' holders (read
/// once by the caller).
pub(crate) fn rows(jobs: Vec<Job>, waiting: &[u32], held: &[tt_lock::LockState]) -> Vec<Row> {
    jobs.into_iter()
        .map(|job| {
            let (gpus, bytes) = job.held_by(held);
            Row {
                state: job.state(waiting),
                job,
                gpus,
                bytes,
            }
        })
        .collect()
}

/// Every user's jobs as rows, from the job records in `records` (`jobs --all
/// --json`'s), given the pids waiting in the queue and the GPUs' locks (read once by
/// the caller), with the records not believed and those damaged.
pub(crate) fn all_rows(
    records: &Path,
    waiting: &[u32],
    held: &[tt_lock::LockState],
) -> Result<(Vec<Row>, Scan)> {
    let mut scan = scan(records)?;
    let jobs = std::mem::take(&mut scan.jobs);
    Ok((rows(jobs, waiting, held), scan))
}

/// A job's log for reading: never through a link at its name's end, never blocking on
/// a FIFO (a reader of another user's planted FIFO would wait for ever), and only a
/// regular file.
pub(crate) fn open_log(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(
            "not a regular file (a FIFO, a device or a directory): not read",
        ));
    }
    Ok(file)
}

/// The jobs `id` names: every task of the array `id` (the caller's own first), else the
/// one job [`find`] finds.
pub(crate) fn resolve(records: &Path, id: &str) -> Result<Vec<Job>> {
    let jobs = all_jobs(records)?;
    let of_array = |mine: bool| -> Vec<Job> {
        let mut tasks: Vec<Job> = jobs
            .iter()
            .filter(|j| (j.uid == tt_lock::euid()) == mine)
            .filter(|j| j.array.as_ref().is_some_and(|a| a.id == id))
            .cloned()
            .collect();
        tasks.sort_by_key(|j| j.array.as_ref().map(|a| a.index));
        tasks
    };
    for mine in [true, false] {
        let tasks = of_array(mine);
        if !tasks.is_empty() {
            return Ok(tasks);
        }
    }
    Ok(vec![find(records, id)?])
}

/// A detached job's id, in the environment of its torchtools and command.
pub(crate) const JOB_ID_ENV: &str = "TORCHTOOLS_JOB_ID";

/// A detached job's log, beside its id.
pub(crate) const JOB_LOG_ENV: &str = "TORCHTOOLS_JOB_LOG";

#[cfg(test)]
mod tests {
    use super::*;

    /// A keeper that saved its outcome and exited between a reader's reading of the
    /// record and its look for the keeper: the job reads as cancelled, not lost.
    #[test]
    fn a_job_whose_keeper_saved_and_left_between_two_looks_is_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let me = tt_lock::Holder::current();
        let job = Job {
            id: "123-4".into(),
            user: me.who.user.clone(),
            uid: tt_lock::euid(),
            host: me.who.host,
            boot_id: tt_device::boot_id(),
            command: vec!["true".into()],
            log: dir.path().join("log"),
            since: Since(0.0),
            // No process of ours runs `job-run 123-4`: the keeper is gone.
            keeper_pid: std::process::id(),
            pid_ns: tt_lock::own_pid_namespace(),
            pid: None,
            ended_unix: None,
            status: None,
            after: Vec::new(),
            after_ok: vec!["123-3".into()],
            waiting_for: Some("123-3".into()),
            cancelled: None,
            timed_out: false,
            requeue: false,
            runs: 0,
            array: None,
        };
        save(dir.path(), &job).unwrap();
        let records = dir.path().to_owned();
        let mut cancelled = job.clone();
        cancelled.cancelled = Some("job 123-3 failed".into());
        BETWEEN_READS.with(|hook| {
            hook.set(Some(Box::new(move |_: &Path| {
                save(&records, &cancelled).unwrap();
            })))
        });
        let read = load(&record_path(dir.path(), "123-4")).unwrap();
        assert_eq!(read.cancelled.as_deref(), Some("job 123-3 failed"));
        assert_eq!(read.state(&[]), "cancelled: job 123-3 failed");
    }

    /// A job's start is `since_unix`, as in every other record; for one release it is
    /// also written as `started_unix` (what the earlier version reads), and a record of
    /// the earlier version, which has only that, reads the same.
    #[test]
    fn a_jobs_start_is_since_unix_and_the_earlier_name_still_reads() {
        let mut written: serde_json::Value = serde_json::json!({
            "id": "1-1", "user": "ada", "uid": 1000, "host": "h", "boot_id": "b",
            "command": ["run", "--", "true"], "log": "/tmp/x.log", "keeper_pid": 7,
        });
        for key in ["since_unix", "started_unix"] {
            let mut record = written.clone();
            record[key] = serde_json::json!(1234.5);
            let job: Job = serde_json::from_value(record).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(job.since, Since(1234.5), "{key}");
            let again = serde_json::to_value(&job).unwrap();
            assert_eq!(
                (&again["since_unix"], &again["started_unix"]),
                (&serde_json::json!(1234.5), &serde_json::json!(1234.5))
            );
            let back: Job = serde_json::from_value(again).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(back, job);
        }
        written["ended_unix"] = serde_json::json!(1.0);
        let missing = serde_json::from_value::<Job>(written)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("since_unix"), "{missing}");
    }
}
