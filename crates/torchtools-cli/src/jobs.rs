//! Runs that outlive the terminal: `--detach` on `reserve`, `run` and `launch` starts
//! the same command in a session of its own (a terminal's hang-up or the user logging
//! out does not reach it), its output in a log file, and prints a job id at once;
//! `jobs`, `logs` and `stop` find it again.
//!
//! A detached job is `torchtools job-run ID -- ARGS`: a small keeper, leader of the
//! job's session, that runs `torchtools ARGS` with the output in the log, ignores the
//! signals meant for the job, and writes how it ended into the job's record. Records
//! live in the lock directory as `job-ID.json`, each written by its job's user (mode
//! 0644: every user's jobs are visible with `--all`, and only their owner can change
//! them); a record whose user is not its file's owner is ignored and said, and one
//! that cannot be read is listed as damaged. Logs are in the user's own state
//! directory.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tt_lock::LockDir;

use crate::arg_groups::DetachArgs;
use crate::exit::Exit;
use crate::hook::{Guardian, Hook};

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
    pub(crate) started_unix: f64,
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

/// A task of a job array: the array's id and this task's index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct ArrayTask {
    pub(crate) id: String,
    pub(crate) index: u32,
}

/// The variable that tells an array's task its index (`--array`).
pub(crate) const ARRAY_TASK_ENV: &str = "TORCHTOOLS_ARRAY_TASK_ID";

use tt_device::now_unix;

fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Sends `signal` to `pid` (a process of a job, found in its record).
fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
}

/// The directory of job records: the lock directory itself (`TORCHTOOLS_LOCK_DIR`),
/// sticky, where only a record's owner (and the directory's owner, root on a server
/// set up well) can change or remove it. Not a subdirectory: whoever created that
/// could remove every user's records in it.
fn records_dir() -> Result<PathBuf> {
    records_dir_in(&LockDir::from_env()?)
}

/// [`records_dir`] of a lock directory already open.
fn records_dir_in(locks: &LockDir) -> Result<PathBuf> {
    Ok(locks.path().to_owned())
}

/// The most a job record's file is read (a record is a few hundred bytes).
const MAX_RECORD: u64 = 1 << 20;

/// What job records are named: `job-ID.json`.
const RECORD_PREFIX: &str = "job-";

fn record_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{RECORD_PREFIX}{id}.json"))
}

/// `id`, or `id-2`, `id-3`... when a file of that name is there already (an id is
/// predictable: another user may have put a file under its name first, which this
/// user could then neither replace nor remove).
fn free_id(records: &Path, id: &str) -> String {
    (1..)
        .map(|n| match n {
            1 => id.to_owned(),
            n => format!("{id}-{n}"),
        })
        .find(|id| fs::symlink_metadata(record_path(records, id)).is_err())
        .unwrap_or_else(|| id.to_owned())
}

/// Writes `job` atomically (a temporary file renamed over the record), readable by all.
fn save(dir: &Path, job: &Job) -> Result<()> {
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

fn load(path: &Path) -> Option<Job> {
    match read_record(path) {
        Record::Job(job) => Some(*job),
        _ => None,
    }
}

/// What a job record file holds, as a reader finds it.
enum Record {
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
fn read_record(path: &Path) -> Record {
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

/// The user's default log directory: `$XDG_STATE_HOME/torchtools/logs`, else
/// `~/.local/state/torchtools/logs`.
fn default_log_dir() -> Result<PathBuf> {
    if let Some(state) = std::env::var_os("XDG_STATE_HOME").filter(|s| !s.is_empty()) {
        return Ok(PathBuf::from(state).join("torchtools/logs"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither XDG_STATE_HOME nor HOME is set: give --log-dir DIR")?;
    Ok(PathBuf::from(home).join(".local/state/torchtools/logs"))
}

/// `argv` without torchtools' own `--detach`, `--log-dir DIR`, `--after JOBS`,
/// `--after-ok JOBS` and the hook's options (the keeper runs the hook): the command the
/// job runs. `command` is how many of `argv`'s last words are the user's command (clap's
/// parsed command, which is `argv`'s tail word for word): nothing of it is touched, so
/// a script's own `--detach` or `--log-dir` reaches it, also where `launch` takes the
/// script without a `--` (torchrun's form).
pub(crate) fn without_detach(argv: &[OsString], command: usize) -> Vec<OsString> {
    let head = argv.len().saturating_sub(command);
    let mut out = Vec::with_capacity(argv.len());
    let mut i = 0;
    while i < head {
        let a = &argv[i];
        if a == "--" {
            break;
        } else if a == "--detach" || a == "--no-on-end" || a == "--requeue" {
            i += 1;
            continue;
        } else if [
            "--log-dir",
            "--after",
            "--after-ok",
            "--on-end",
            "--on-end-timeout",
            "--array",
        ]
        .iter()
        .any(|o| a == *o)
        {
            i += 2;
            continue;
        } else if [
            "--log-dir=",
            "--after=",
            "--after-ok=",
            "--on-end=",
            "--on-end-timeout=",
            "--array=",
        ]
        .iter()
        .any(|o| a.to_string_lossy().starts_with(o))
        {
            i += 1;
            continue;
        }
        out.push(a.clone());
        i += 1;
    }
    out.extend_from_slice(&argv[i.min(argv.len())..]);
    out
}

/// The directory a detached job's log goes to (`--log-dir`, else the default),
/// created, and absolute in the job's record: `logs` may be run from elsewhere.
fn log_dir(given: Option<&Path>) -> Result<PathBuf> {
    let log_dir = match given {
        // Absolute in the job's record: `logs` may be run from another directory.
        Some(d) => std::path::absolute(d).map_err(|e| {
            Exit(
                2,
                format!("--log-dir {}: cannot resolve it: {e}", d.display()),
            )
        })?,
        None => default_log_dir()?,
    };
    fs::create_dir_all(&log_dir).map_err(|e| {
        Exit(
            2,
            format!("--log-dir {}: cannot create it: {e}", log_dir.display()),
        )
    })?;
    Ok(log_dir)
}

/// Starts the command line `argv` (this process's own arguments) as a detached job;
/// its last `command` words are the user's command (see [`without_detach`]).
/// `hook` goes to the keeper in its environment, never into the record others read.
pub(crate) fn detach(
    args: &DetachArgs,
    argv: &[OsString],
    command: usize,
    hook: Option<&Hook>,
) -> Result<ExitCode> {
    let log_dir = log_dir(args.log_dir.as_deref())?;
    let records = records_dir()?;
    // Every job waited for must exist (another user's may be waited for too: records
    // are readable by all), before anything starts.
    let resolve = |ids: &[String]| -> Result<Vec<String>> {
        ids.iter()
            .map(|id| find(&records, id).map(|j| j.id))
            .collect()
    };
    let (after, after_ok) = (resolve(&args.after)?, resolve(&args.after_ok)?);
    let started = now_unix();
    let base = free_id(
        &records,
        &format!("{}-{}", started as u64, std::process::id()),
    );
    let command = without_detach(argv.get(1..).unwrap_or_default(), command);
    let Some(spec) = &args.array else {
        let job = start_job(&Start {
            records: &records,
            log_dir: &log_dir,
            id: base.clone(),
            command: &command,
            hook,
            after,
            after_ok,
            requeue: args.requeue,
            array: None,
            started,
        })?;
        println!("{base}");
        eprintln!(
            "torchtools: started job {base} (log: {}); `torchtools logs {base} -f` follows \
             it, `torchtools stop {base}` stops it",
            job.log.display()
        );
        return Ok(ExitCode::SUCCESS);
    };
    // One job per index; with `%K`, each waits for the task K places before it.
    let mut ids: Vec<String> = Vec::with_capacity(spec.indices.len());
    for (place, &index) in spec.indices.iter().enumerate() {
        let id = free_id(&records, &format!("{base}_{index}"));
        let mut after = after.clone();
        if let Some(k) = spec.at_once {
            if let Some(before) = place.checked_sub(k).and_then(|p| ids.get(p)) {
                after.push(before.clone());
            }
        }
        start_job(&Start {
            records: &records,
            log_dir: &log_dir,
            id: id.clone(),
            command: &command,
            hook,
            after,
            after_ok: after_ok.clone(),
            requeue: args.requeue,
            array: Some(ArrayTask {
                id: base.clone(),
                index,
            }),
            started,
        })?;
        ids.push(id);
    }
    println!("{base}");
    eprintln!(
        "torchtools: started job array {base}: {} job(s), {} to {}{}; `torchtools jobs` \
         lists them, `torchtools stop {base}` stops them all",
        ids.len(),
        ids.first().map_or("", String::as_str),
        ids.last().map_or("", String::as_str),
        spec.at_once
            .map_or(String::new(), |k| format!(", at most {k} at once"))
    );
    Ok(ExitCode::SUCCESS)
}

/// What [`start_job`] starts.
struct Start<'a> {
    records: &'a Path,
    log_dir: &'a Path,
    id: String,
    command: &'a [OsString],
    hook: Option<&'a Hook>,
    after: Vec<String>,
    after_ok: Vec<String>,
    requeue: bool,
    array: Option<ArrayTask>,
    started: f64,
}

/// Starts one detached job: its log, its keeper in a session of its own, its record.
fn start_job(start: &Start<'_>) -> Result<Job> {
    let id = &start.id;
    let log = start.log_dir.join(format!("{id}.log"));
    let out = OpenOptions::new()
        .append(true)
        .create_new(true)
        .mode(0o600)
        .open(&log)
        .map_err(|e| {
            Exit(
                2,
                format!(
                    "--log-dir {}: cannot write a log there: {e}",
                    start.log_dir.display()
                ),
            )
        })?;
    let err = out.try_clone()?;
    let exe = std::env::current_exe().context("finding this program")?;
    let mut keeper = Command::new(&exe);
    keeper
        .arg("job-run")
        .arg(id)
        .arg("--")
        .args(start.command)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    Hook::pass(start.hook, &mut keeper);
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        keeper.pre_exec(|| {
            nix::unistd::setsid()
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let child = keeper.spawn().context("starting the detached job")?;
    let me = tt_lock::Holder::current();
    let job = Job {
        id: id.clone(),
        user: me.user,
        uid: uid(),
        host: me.host,
        boot_id: boot_id(),
        command: std::iter::once("torchtools".to_owned())
            .chain(
                start
                    .command
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned()),
            )
            .collect(),
        log,
        started_unix: start.started,
        keeper_pid: child.id(),
        pid_ns: tt_lock::own_pid_namespace(),
        pid: None,
        ended_unix: None,
        status: None,
        waiting_for: start.after.iter().chain(&start.after_ok).next().cloned(),
        after: start.after.clone(),
        after_ok: start.after_ok.clone(),
        cancelled: None,
        timed_out: false,
        requeue: start.requeue,
        runs: 0,
        array: start.array.clone(),
    };
    save(start.records, &job)?;
    Ok(job)
}

/// `torchtools job-run ID -- ARGS`: the detached job's keeper (see the module's
/// documentation).
pub(crate) fn keep(id: &str, command: &[OsString]) -> Result<ExitCode> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // Taken before any thread starts, and kept from the job's own environment.
    let hook = Hook::take_passed();
    // The job's signals are for the job: the keeper stays to write how it ended.
    let mut signals = signal_hook::iterator::Signals::new([SIGHUP, SIGINT, SIGTERM])
        .context("installing the keeper's signal handlers")?;
    // SIGTERM or SIGINT (from `torchtools stop`): the job is being stopped, and is not
    // requeued when it exits 75.
    let stopping = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stopping);
    std::thread::spawn(move || {
        for signal in signals.forever() {
            if signal != SIGHUP {
                flag.store(true, Ordering::Relaxed);
            }
        }
    });
    let records = records_dir()?;
    let path = record_path(&records, id);
    // The starter writes the record once the keeper runs: wait for it.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut job = loop {
        // Only this user's record of this id (another user's is never run).
        if let Some(job) = load(&path).filter(|j| j.uid == uid() && j.id == id) {
            break job;
        }
        if Instant::now() > deadline {
            bail!("job {id}: its record {} never appeared", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The hook's guardian, from the start: it runs the hook even if this keeper is
    // killed (the job is then lost).
    let mut guardian = match &hook {
        Some(hook) => Some(Guardian::start(
            hook,
            id,
            job.command.clone(),
            Some(job.log.clone()),
            job.started_unix,
        )?),
        None => None,
    };
    if let Some(why) = wait_for_dependencies(&records, &mut job, &stopping)? {
        job.cancelled = Some(why.clone());
        job.waiting_for = None;
        job.ended_unix = Some(now_unix());
        save(&records, &job)?;
        eprintln!("torchtools: job {id} cancelled without running: {why}");
        if let Some(g) = guardian {
            g.cancelled(&why);
        }
        return Ok(ExitCode::from(1));
    }
    let code = run_until_done(&records, &path, &mut job, command, &mut guardian, &stopping)?;
    job.ended_unix = Some(now_unix());
    job.status = Some(code);
    save(&records, &job)?;
    if let Some(g) = guardian {
        g.ended(code);
    }
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// Runs the job's command (its `torchtools`), again each time it exits 75 when the
/// job is `--requeue`d and not being stopped: its exit status at last.
fn run_until_done(
    records: &Path,
    path: &Path,
    job: &mut Job,
    command: &[OsString],
    guardian: &mut Option<Guardian>,
    stopping: &AtomicBool,
) -> Result<i32> {
    let exe = std::env::current_exe().context("finding this program")?;
    loop {
        job.runs += 1;
        job.timed_out = false;
        let mut child = Command::new(&exe)
            .args(command)
            .stdin(Stdio::null())
            // The job and its command know which job they are, and which run.
            .env(crate::hook::JOB_ID_ENV, &job.id)
            .env(crate::hook::JOB_LOG_ENV, &job.log)
            .env(JOB_RUN_ENV, job.runs.to_string())
            .envs(
                job.array
                    .as_ref()
                    .map(|a| (ARRAY_TASK_ENV, a.index.to_string())),
            )
            .spawn()
            .context("starting the job")?;
        job.pid = Some(child.id());
        if let Some(g) = guardian.as_mut() {
            g.pid(child.id());
        }
        save(records, job)?;
        let status = loop {
            match child.wait() {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).context("waiting for the job"),
            }
        };
        use std::os::unix::process::ExitStatusExt;
        let code = tt_device::shell_status(status.code(), status.signal());
        // What the job's torchtools marked meanwhile (its time limit reached).
        if let Some(latest) = load(path).filter(|j| j.uid == uid() && j.id == job.id) {
            job.timed_out = latest.timed_out;
        }
        if code != i32::from(tt_device::EX_TEMPFAIL as u8)
            || !job.requeue
            || stopping.load(Ordering::Relaxed)
        {
            return Ok(code);
        }
        eprintln!(
            "torchtools: job {} exited 75 after run {}{}: requeued, it runs again once \
             the queue serves it",
            job.id,
            job.runs,
            if job.timed_out {
                " (its time limit)"
            } else {
                ""
            }
        );
    }
}

/// The variable that tells a detached job's command which run it is: 1, then 2 after
/// a first requeue, ...
pub(crate) const JOB_RUN_ENV: &str = "TORCHTOOLS_JOB_RUN";

/// Marks the detached job this process runs in (its `TORCHTOOLS_JOB_ID`, this user's
/// record) as ended by its time limit; nothing outside a job.
pub(crate) fn mark_timed_out() {
    let Some(id) = std::env::var_os(crate::hook::JOB_ID_ENV) else {
        return;
    };
    let id = id.to_string_lossy();
    let Ok(records) = records_dir() else {
        return;
    };
    let path = record_path(&records, &id);
    if let Some(mut job) = load(&path).filter(|j| j.uid == uid() && j.id == id) {
        job.timed_out = true;
        if let Err(e) = save(&records, &job) {
            tracing::warn!("cannot mark job {id} as timed out: {e}");
        }
    }
}

/// How often a job waiting for others looks at their records.
const DEPENDENCY_POLL: Duration = Duration::from_millis(200);

/// Waits until every job `job` starts after has ended (saying which one it waits for in
/// its record); `Some(why)` when `job` must not run: an `--after-ok` job that did not
/// succeed (failed, cancelled, lost), or the job stopped meanwhile (`stopping`).
fn wait_for_dependencies(
    records: &Path,
    job: &mut Job,
    stopping: &AtomicBool,
) -> Result<Option<String>> {
    let all: Vec<String> = job.after.iter().chain(&job.after_ok).cloned().collect();
    loop {
        if stopping.load(Ordering::Relaxed) {
            return Ok(Some("stopped before it started".into()));
        }
        let pending = all
            .iter()
            .find(|id| load(&record_path(records, id)).is_some_and(|dep| !ended(&dep)));
        match pending {
            Some(id) => {
                if job.waiting_for.as_ref() != Some(id) {
                    job.waiting_for = Some(id.clone());
                    save(records, job)?;
                }
                std::thread::sleep(DEPENDENCY_POLL);
            }
            None => break,
        }
    }
    job.waiting_for = None;
    save(records, job)?;
    // A record gone (removed by its owner) counts as a job that did not succeed.
    Ok(job
        .after_ok
        .iter()
        .find(|id| load(&record_path(records, id)).is_none_or(|dep| outcome(&dep) != 0))
        .map(|failed| format!("job {failed} failed")))
}

/// How an ended job ended, as one status: its exit status; 1 when it was cancelled or
/// lost (its keeper killed, the machine rebooted).
fn outcome(job: &Job) -> i32 {
    match (job.status, &job.cancelled) {
        (Some(code), _) => code,
        _ => 1,
    }
}

/// An ended job's state, from its exit status: "finished", "failed (3)", "killed by
/// signal 9", "preempted (75)" (`jobs` and the `--on-end` hook's TORCHTOOLS_JOB_STATE).
pub(crate) fn status_text(code: i32) -> String {
    match code {
        0 => "finished".into(),
        75 => "preempted (75)".into(),
        c if c > 128 => format!("killed by signal {}", c - 128),
        c => format!("failed ({c})"),
    }
}

/// A job's state, as `jobs` says it, with the run it is in when it was requeued:
/// `running (run 2)`.
fn state(job: &Job, waiting_pids: &[u32]) -> String {
    let base = base_state(job, waiting_pids);
    match job.runs {
        0 | 1 => base,
        n => format!("{base} (run {n})"),
    }
}

/// [`state`] without the run.
fn base_state(job: &Job, waiting_pids: &[u32]) -> String {
    if let Some(why) = &job.cancelled {
        return format!("cancelled: {why}");
    }
    if let Some(code) = job.status {
        // (A command that met its limit but exited 0 all the same finished.)
        return match job.timed_out && code != 0 {
            true => format!("timeout: {}", status_text(code)),
            false => status_text(code),
        };
    }
    if job.boot_id != boot_id() {
        return "lost (the machine rebooted)".into();
    }
    if elsewhere(job) {
        return "started in another PID namespace".into();
    }
    if !alive(job) {
        return "lost (its keeper was killed)".into();
    }
    if let Some(other) = &job.waiting_for {
        return format!("waiting for job {other}");
    }
    match job.pid {
        Some(pid) if waiting_pids.contains(&pid) => "waiting".into(),
        Some(_) => "running".into(),
        None => "starting".into(),
    }
}

/// Whether `job` was started in another PID namespace (a container, or the host seen
/// from one), where its pids mean other processes than here.
fn elsewhere(job: &Job) -> bool {
    job.pid_ns.is_some() && job.pid_ns != tt_lock::own_pid_namespace()
}

/// Whether `job` has ended: its status is recorded, or (in its own PID namespace) its
/// keeper is gone. From another namespace only the record can say.
fn ended(job: &Job) -> bool {
    job.status.is_some()
        || job.cancelled.is_some()
        || job.boot_id != boot_id()
        || (!elsewhere(job) && !alive(job))
}

/// Whether `job`'s keeper still runs: its pid is a `job-run` of this id (a pid alone
/// could be another process's by now).
fn alive(job: &Job) -> bool {
    // Its user's (another user's process named so is not it); no start time check:
    // the id in its arguments already names this job.
    of_jobs_user(job, job.keeper_pid)
        && tt_device::procfs::cmdline(job.keeper_pid)
            .is_some_and(|args| args.windows(2).any(|w| w[0] == "job-run" && w[1] == job.id))
}

/// Whether `pid` is a process of `job`'s user.
fn of_jobs_user(job: &Job, pid: u32) -> bool {
    tt_device::procfs::uid(pid) == Some(job.uid)
}

/// Whether `pid` can be one of `job`'s processes: it belongs to the job's user and
/// started no earlier than the job (a pid is reused: an older process, or another
/// user's, under a pid the record names is not the job's, and is never signalled).
fn is_jobs(job: &Job, pid: u32) -> bool {
    // btime is whole seconds: a process may seem to start up to a second early.
    const SLACK: f64 = 2.0;
    of_jobs_user(job, pid)
        && tt_device::procfs::started_unix(pid).is_some_and(|t| t >= job.started_unix - SLACK)
}

/// Every job's record in `records`, oldest first.
fn all_jobs(records: &Path) -> Result<Vec<Job>> {
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

fn scan(records: &Path) -> Result<Scan> {
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
        a.started_unix.total_cmp(&b.started_unix).then_with(|| {
            a.array
                .as_ref()
                .map(|t| t.index)
                .cmp(&b.array.as_ref().map(|t| t.index))
        })
    });
    Ok(scan)
}

/// The job `id` names: exactly, or by a unique prefix; `last`: the user's latest.
fn find(records: &Path, id: &str) -> Result<Job> {
    let jobs = all_jobs(records)?;
    if id == "last" {
        return jobs
            .into_iter()
            .rev()
            .find(|j| j.uid == uid())
            .ok_or_else(|| Exit(2, "you have no job yet".into()).into());
    }
    // Exactly the id, else a prefix; among the caller's own jobs first, so that nobody
    // else's record can make the caller's id ambiguous.
    let (mine, others): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.uid == uid());
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
        0 => Err(Exit(
            2,
            format!("no job {id:?}: `torchtools jobs --all` lists them"),
        )
        .into()),
        n => Err(Exit(
            2,
            format!("{n} jobs start with {id:?}: give more of the id"),
        )
        .into()),
    }
}

/// The GPUs a running job holds and the bytes it reserved on them: the locks whose
/// holder is the job's torchtools.
fn held_by(job: &Job, locks: &[tt_lock::LockState]) -> (Vec<String>, Option<u64>) {
    let Some(pid) = job.pid else {
        return (Vec::new(), None);
    };
    let mut gpus = Vec::new();
    let mut bytes = None;
    for state in locks.iter().filter(|s| s.held) {
        if let Some(h) = state
            .holder
            .as_ref()
            .filter(|h| h.pid == pid && h.host == job.host)
        {
            gpus.push(h.gpu.clone());
            bytes = h.reserved.map(|b| b.0).or(bytes);
        }
    }
    (gpus, bytes)
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

/// Every user's jobs that have not ended, given the requests waiting in `locks`' queue
/// (read once by the caller).
pub(crate) fn live_jobs(locks: &LockDir, queue: &[tt_lock::Waiter]) -> Result<Vec<LiveJob>> {
    let waiting: Vec<u32> = queue.iter().map(|w| w.pid).collect();
    let held = locks.list()?;
    Ok(all_jobs(&records_dir_in(locks)?)?
        .into_iter()
        .filter(|job| !ended(job))
        .map(|job| {
            let (gpus, bytes) = held_by(&job, &held);
            LiveJob {
                waiting: state(&job, &waiting).starts_with("waiting"),
                id: job.id,
                user: job.user,
                gpus,
                bytes,
            }
        })
        .collect())
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
            let (gpus, bytes) = held_by(&job, held);
            Row {
                state: state(&job, waiting),
                job,
                gpus,
                bytes,
            }
        })
        .collect()
}

/// Every user's jobs as rows, from the lock directory (`jobs --all --json`'s), with
/// the records not believed and those damaged.
pub(crate) fn all_rows(locks: &LockDir, queue: &[tt_lock::Waiter]) -> Result<(Vec<Row>, Scan)> {
    let waiting: Vec<u32> = queue.iter().map(|w| w.pid).collect();
    let held = locks.list()?;
    let mut scan = scan(&records_dir_in(locks)?)?;
    let jobs = std::mem::take(&mut scan.jobs);
    Ok((rows(jobs, &waiting, &held), scan))
}

pub(crate) fn jobs(json: bool, all: bool) -> Result<ExitCode> {
    let locks = LockDir::from_env()?;
    let waiting: Vec<u32> = locks
        .queue()
        .map(|q| q.iter().map(|w| w.pid).collect())
        .unwrap_or_default();
    let held = locks.list().unwrap_or_default();
    let mine = uid();
    let scan = scan(&records_dir_in(&locks)?)?;
    let jobs: Vec<Job> = scan
        .jobs
        .into_iter()
        .filter(|j| all || j.uid == mine)
        .collect();
    if !json {
        crate::ignored::say(&scan.ignored);
        crate::policy::say_if_ignored(&locks);
        for why in &scan.damaged {
            println!("damaged job record (not a job torchtools wrote): {why}");
        }
    }
    if json {
        let rows = rows(jobs, &waiting, &held);
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if jobs.is_empty() {
        println!(
            "no job{}",
            if all {
                ""
            } else {
                " of yours (--all: everyone's)"
            }
        );
        return Ok(ExitCode::SUCCESS);
    }
    let now = now_unix();
    for job in &jobs {
        let took = job.ended_unix.unwrap_or(now) - job.started_unix;
        let (gpus, bytes) = held_by(job, &held);
        let gpus = if gpus.is_empty() {
            "-".to_owned()
        } else {
            let each = bytes.map_or(String::new(), |b| {
                format!(" ({} each)", tt_device::Bytes(b))
            });
            format!("GPU {}{each}", gpus.join(","))
        };
        println!(
            "{}  {:<8}  {:<24}  {:>7}  {}  {}  {}",
            tt_device::printable(&job.id),
            tt_device::printable(&job.user),
            tt_device::printable(&state(job, &waiting)),
            format!("{:.0}s", took.max(0.0)),
            gpus,
            crate::args::shown(&job.command),
            tt_device::printable(&job.log.to_string_lossy())
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn logs(id: &str, follow: bool) -> Result<ExitCode> {
    let records = records_dir()?;
    let job = find(&records, id)?;
    let mut file = open_log(&job.log).map_err(|e| {
        Exit(
            1,
            format!(
                "job {}: cannot read its log {}: {e}",
                job.id,
                job.log.display()
            ),
        )
    })?;
    let mut out = std::io::stdout().lock();
    loop {
        // Copied in pieces, never held whole.
        std::io::copy(&mut file, &mut out)?;
        out.flush()?;
        if !follow {
            return Ok(ExitCode::SUCCESS);
        }
        let now = load(&record_path(&records, &job.id)).unwrap_or(job.clone());
        if ended(&now) {
            // The rest written before it ended.
            std::io::copy(&mut file, &mut out)?;
            out.flush()?;
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
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

/// `torchtools stop ID`: the job, or every task of the array `ID` (those still
/// waiting to start first, so that none starts meanwhile).
pub(crate) fn stop(id: &str, grace: Duration) -> Result<ExitCode> {
    let records = records_dir()?;
    let mut jobs = resolve(&records, id)?;
    jobs.sort_by_key(|j| j.pid.is_some());
    for job in jobs {
        stop_one(&records, job, grace)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The jobs `id` names: every task of the array `id` (the caller's own first), else the
/// one job [`find`] finds.
fn resolve(records: &Path, id: &str) -> Result<Vec<Job>> {
    let jobs = all_jobs(records)?;
    let of_array = |mine: bool| -> Vec<Job> {
        let mut tasks: Vec<Job> = jobs
            .iter()
            .filter(|j| (j.uid == uid()) == mine)
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

fn stop_one(records: &Path, job: Job, grace: Duration) -> Result<()> {
    let me = uid();
    if job.uid != me && me != 0 {
        return Err(Exit(
            1,
            format!(
                "job {} belongs to {} (uid {}): only they (or root) can stop it",
                job.id, job.user, job.uid
            ),
        )
        .into());
    }
    if ended(&job) {
        eprintln!("torchtools: job {} has ended already", job.id);
        return Ok(());
    }
    if elsewhere(&job) {
        return Err(Exit(
            1,
            format!(
                "job {} was started in another PID namespace (a container, or the host seen \
                 from one), where its processes are: stop it from there",
                job.id
            ),
        )
        .into());
    }
    // SIGTERM to the keeper first (a job stopped is not requeued), then to the job's
    // torchtools, which passes it on to the command or the ranks (a torchtools trainer
    // then checkpoints and exits 75).
    if alive(&job) {
        signal(job.keeper_pid, nix::sys::signal::Signal::SIGTERM);
    }
    match job.pid {
        Some(pid) if is_jobs(&job, pid) => signal(pid, nix::sys::signal::Signal::SIGTERM),
        Some(pid) => eprintln!(
            "torchtools: job {}: pid {pid} is no longer its process (another user's, or \
             started after the job): not signalled",
            job.id
        ),
        None => {}
    }
    let deadline = Instant::now() + grace;
    loop {
        let now = load(&record_path(records, &job.id)).unwrap_or(job.clone());
        if ended(&now) {
            eprintln!("torchtools: job {} stopped ({})", job.id, state(&now, &[]));
            return Ok(());
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Past the grace period: everything in the job's session (its torchtools, the
    // command, ranks in process groups of their own) but its keeper, which then
    // records the kill.
    eprintln!(
        "torchtools: job {} still runs {grace:?} after SIGTERM: SIGKILL",
        job.id
    );
    if !alive(&job) {
        eprintln!("torchtools: job {}: its keeper is gone", job.id);
        return Ok(());
    }
    for pid in session_members(job.keeper_pid) {
        if pid != job.keeper_pid && is_jobs(&job, pid) {
            signal(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
    Ok(())
}

/// The processes of session `sid` (field 6 of `/proc/PID/stat`).
fn session_members(sid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| tt_device::procfs::stat(pid).is_some_and(|s| s.session == sid))
        .collect()
}

/// `jobs`' options, or `jobs wait`.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct JobsArgs {
    #[command(subcommand)]
    pub(crate) wait: Option<JobsCommand>,
    /// Everyone's jobs, not only yours.
    #[arg(long)]
    pub(crate) all: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `jobs wait`.
#[derive(clap::Subcommand)]
pub(crate) enum JobsCommand {
    /// Wait until these jobs have ended; exit with the worst status among them (a
    /// cancelled or lost job counts as 1).
    Wait {
        /// The jobs (ids, unique prefixes, or `last`).
        #[arg(required_unless_present = "all_mine", conflicts_with = "all_mine")]
        jobs: Vec<String>,
        /// Every job of yours that has not ended yet.
        #[arg(long)]
        all_mine: bool,
    },
}

/// `torchtools jobs` and `jobs wait`.
pub(crate) fn run(args: JobsArgs) -> Result<ExitCode> {
    match args.wait {
        Some(JobsCommand::Wait { jobs, all_mine }) => wait(&jobs, all_mine),
        None => self::jobs(args.json, args.all),
    }
}

/// `torchtools jobs wait`: returns when every job named has ended, with the worst
/// status (the largest), each job's end said on its line.
fn wait(ids: &[String], all_mine: bool) -> Result<ExitCode> {
    let records = records_dir()?;
    let ids: Vec<String> = if all_mine {
        all_jobs(&records)?
            .into_iter()
            .filter(|j| j.uid == uid() && !ended(j))
            .map(|j| j.id)
            .collect()
    } else {
        let mut all = Vec::new();
        for id in ids {
            all.extend(resolve(&records, id)?.into_iter().map(|j| j.id));
        }
        all
    };
    let mut worst = 0;
    for id in &ids {
        let job = loop {
            match load(&record_path(&records, id)) {
                Some(job) if ended(&job) => break Some(job),
                Some(_) => std::thread::sleep(DEPENDENCY_POLL),
                None => break None,
            }
        };
        let (code, said) = match &job {
            Some(job) => (outcome(job), state(job, &[])),
            None => (1, "its record is gone".to_owned()),
        };
        println!("{id}  {said}");
        worst = worst.max(code);
    }
    Ok(ExitCode::from(u8::try_from(worst).unwrap_or(1)))
}

/// `logs`' options.
#[derive(clap::Args)]
pub(crate) struct LogsArgs {
    /// The job.
    pub(crate) job: String,
    /// Follow the log while the job runs; end when it ends.
    #[arg(short, long)]
    pub(crate) follow: bool,
}

/// `stop`'s options.
#[derive(clap::Args)]
pub(crate) struct StopArgs {
    /// The job.
    pub(crate) job: String,
    /// How long it has to end after SIGTERM.
    #[arg(long, value_parser = crate::args::duration, default_value = "10s")]
    pub(crate) grace: std::time::Duration,
}

/// The keeper's arguments (`job-run ID -- ARGS`).
#[derive(clap::Args)]
pub(crate) struct JobRunArgs {
    pub(crate) id: String,
    #[arg(last = true)]
    pub(crate) command: Vec<std::ffi::OsString>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_runs_the_command_line_without_detach() {
        let words = |w: &[&str]| w.iter().map(OsString::from).collect::<Vec<_>>();
        let argv = words(&[
            "reserve",
            "--detach",
            "--log-dir",
            "/x",
            "--gpu",
            "0",
            "--",
            "sh",
            "--detach",
        ]);
        assert_eq!(
            without_detach(&argv, 2),
            words(&["reserve", "--gpu", "0", "--", "sh", "--detach"])
        );
        let argv = words(&["launch", "--log-dir=/x", "--detach", "train.py"]);
        assert_eq!(without_detach(&argv, 1), words(&["launch", "train.py"]));
        // The dependencies are the detached job's, not the command's it runs.
        let argv = words(&[
            "reserve",
            "--detach",
            "--after",
            "1-2,3-4",
            "--after-ok=5-6",
            "--gpu",
            "0",
            "--",
            "sh",
        ]);
        assert_eq!(
            without_detach(&argv, 1),
            words(&["reserve", "--gpu", "0", "--", "sh"])
        );
        // torchrun's form: the script's own options after it are the script's, whatever
        // their names (the bug: `--log-dir out --detach` were taken for ours).
        let argv = words(&[
            "launch",
            "--detach",
            "--nproc-per-node",
            "1",
            "argv.py",
            "--log-dir",
            "out",
            "--detach",
            "x",
            "--",
            "--log-dir=y",
        ]);
        assert_eq!(
            without_detach(&argv, 7),
            words(&[
                "launch",
                "--nproc-per-node",
                "1",
                "argv.py",
                "--log-dir",
                "out",
                "--detach",
                "x",
                "--",
                "--log-dir=y",
            ])
        );
    }
}
