//! The keeper of a detached job (`--detach` on `reserve`, `run` and `launch`): the
//! job started in a session of its own, its output in a log file, and
//! `torchtools job-run ID -- ARGS` as its session's leader, which runs `torchtools ARGS`,
//! ignores the signals meant for the job, waits for the jobs it comes `--after`,
//! requeues it (`--requeue`), and writes how it ended into its record.

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tt_device::now_unix;

use crate::arg_groups::DetachArgs;
use crate::exit::Exit;
use crate::hook::{Guardian, Hook};
use crate::jobs::store::{
    find, free_id, load, load_own, record_path, records_dir, save, ArrayTask, Job, Since,
    ARRAY_TASK_ENV, JOB_RUN_ENV,
};

/// The user's default log directory: `$XDG_STATE_HOME/torchtools/logs`, else
/// `~/.local/state/torchtools/logs`.
pub(crate) fn default_log_dir() -> Result<PathBuf> {
    let state = tt_device::user_dir("XDG_STATE_HOME", ".local/state")
        .context("neither XDG_STATE_HOME nor HOME is set: give --log-dir DIR")?;
    Ok(state.join("torchtools/logs"))
}

/// `argv` without torchtools' own `--detach`, `--log-dir DIR`, `--after JOBS`,
/// `--after-ok JOBS`, `--slurm`, `--no-slurm` and the hook's options (the keeper runs the hook): the
/// command the job runs. `command` is how many of `argv`'s last words are the user's
/// command (clap's parsed command, which is `argv`'s tail word for word): nothing of it
/// is touched, so a script's own `--detach` or `--log-dir` reaches it, also where
/// `launch` takes the script without a `--` (torchrun's form).
pub(crate) fn without_detach(argv: &[OsString], command: usize) -> Vec<OsString> {
    without_options(
        argv,
        command,
        &[
            "--detach",
            "--no-on-end",
            "--requeue",
            "--slurm",
            "--no-slurm",
            "--dry-run",
        ],
        &[
            "--log-dir",
            "--after",
            "--after-ok",
            "--on-end",
            "--on-end-timeout",
            "--array",
        ],
    )
}

/// `argv` without torchtools' options named in `flags` (alone) and `valued` (with
/// their value, as `--opt V` or `--opt=V`), up to its `--` or its last `command` words
/// (the user's command), which are kept as they are.
pub(crate) fn without_options(
    argv: &[OsString],
    command: usize,
    flags: &[&str],
    valued: &[&str],
) -> Vec<OsString> {
    let head = argv.len().saturating_sub(command);
    let mut out = Vec::with_capacity(argv.len());
    let mut i = 0;
    while i < head {
        let a = &argv[i];
        if a == "--" {
            break;
        } else if flags.iter().any(|o| a == *o) {
            i += 1;
            continue;
        } else if valued.iter().any(|o| a == *o) {
            i += 2;
            continue;
        } else if valued
            .iter()
            .any(|o| a.to_string_lossy().starts_with(&format!("{o}=")))
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
pub(crate) fn log_dir(given: Option<&Path>) -> Result<PathBuf> {
    let log_dir = match given {
        // Absolute in the job's record: `logs` may be run from another directory.
        Some(d) => std::path::absolute(d).map_err(|e| {
            Exit::usage(format!("--log-dir {}: cannot resolve it: {e}", d.display()))
        })?,
        None => default_log_dir()?,
    };
    fs::create_dir_all(&log_dir).map_err(|e| {
        Exit::usage(format!(
            "--log-dir {}: cannot create it: {e}",
            log_dir.display()
        ))
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
pub(crate) struct Start<'a> {
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
pub(crate) fn start_job(start: &Start<'_>) -> Result<Job> {
    let id = &start.id;
    let log = start.log_dir.join(format!("{id}.log"));
    let out = OpenOptions::new()
        .append(true)
        .create_new(true)
        .mode(0o600)
        .open(&log)
        .map_err(|e| {
            Exit::usage(format!(
                "--log-dir {}: cannot write a log there: {e}",
                start.log_dir.display()
            ))
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
        user: me.who.user,
        uid: tt_lock::euid(),
        host: me.who.host,
        boot_id: tt_device::boot_id(),
        command: std::iter::once("torchtools".to_owned())
            .chain(
                start
                    .command
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned()),
            )
            .collect(),
        log,
        since: Since(start.started),
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
        if let Some(job) = load_own(&path, id) {
            break job;
        }
        if Instant::now() > deadline {
            bail!("job {id}: its record {} never appeared", path.display());
        }
        std::thread::sleep(crate::process::LOOK_EVERY);
    };
    // The hook's guardian, from the start: it runs the hook even if this keeper is
    // killed (the job is then lost).
    let mut guardian = match &hook {
        Some(hook) => Some(Guardian::start(
            hook,
            id,
            job.command.clone(),
            Some(job.log.clone()),
            job.since.0,
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
pub(crate) fn run_until_done(
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
            .env(crate::jobs::store::JOB_ID_ENV, &job.id)
            .env(crate::jobs::store::JOB_LOG_ENV, &job.log)
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
        if let Some(latest) = load_own(path, &job.id) {
            job.timed_out = latest.timed_out;
        }
        if code != i32::from(crate::exit::TEMPFAIL)
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

/// How often a job waiting for others looks at their records.
pub(crate) const DEPENDENCY_EVERY: Duration = Duration::from_millis(200);

/// Waits until every job `job` starts after has ended (saying which one it waits for in
/// its record); `Some(why)` when `job` must not run: an `--after-ok` job that did not
/// succeed (failed, cancelled, lost), or the job stopped meanwhile (`stopping`).
pub(crate) fn wait_for_dependencies(
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
            .find(|id| load(&record_path(records, id)).is_some_and(|dep| !dep.ended()));
        match pending {
            Some(id) => {
                if job.waiting_for.as_ref() != Some(id) {
                    job.waiting_for = Some(id.clone());
                    save(records, job)?;
                }
                std::thread::sleep(DEPENDENCY_EVERY);
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
        .find(|id| load(&record_path(records, id)).is_none_or(|dep| dep.outcome() != 0))
        .map(|failed| format!("job {failed} failed")))
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
