//! Slurm's jobs in `jobs`, `logs`, `stop` and `jobs wait`: on a machine that is part of
//! a Slurm cluster, a job submitted with `--slurm` (or with `sbatch`) is Slurm's, and
//! what it is (waiting, running, ended and how) is what Slurm's controller says. It is
//! read from `squeue --json` (Slurm 22.05's `openapi/v0.0.38` and later shapes), never
//! from columns of text that a job's name or paths could shift; its output is the file
//! Slurm writes. Stopping is `scancel`'s; Slurm's `KillWait` is its grace.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::exit::Exit;
use crate::jobs::store::Job;

/// How long `squeue` or `scancel` may take to answer before it is given up on (a
/// controller that does not answer costs each try Slurm's `MessageTimeout`, 10 s by
/// default, and its retries).
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// How often `jobs wait`, `stop` and `logs --follow` ask Slurm again (each asking is
/// one `squeue` call to the controller).
pub(crate) const ASK_EVERY: Duration = Duration::from_secs(1);

/// The states in which a Slurm job has ended for good (a requeued job goes back to
/// `PENDING` instead).
const ENDED: [&str; 9] = [
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
];

/// A Slurm job (or an array's task) as its controller describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct SlurmJob {
    /// Always `"slurm"`: `jobs --json` lists torchtools' jobs beside Slurm's.
    pub(crate) scheduler: &'static str,
    /// As `squeue` and `scancel` take it: `57`, an array's task `57_3`, or the tasks
    /// of an array not started yet `57_[1-3%1]`.
    pub(crate) id: String,
    /// Slurm's own number of this job (an array's task has one of its own).
    pub(crate) job_id: u64,
    /// The array's id, for an array's task.
    pub(crate) array_job_id: Option<u64>,
    pub(crate) array_task_id: Option<u64>,
    pub(crate) user: String,
    pub(crate) uid: u32,
    /// `PENDING`, `RUNNING`, `COMPLETED`, `FAILED`, `CANCELLED`, `TIMEOUT`, ...
    pub(crate) state: String,
    /// Why it waits, or why it ended (`Resources`, `Dependency`, `NonZeroExitCode`).
    pub(crate) reason: String,
    pub(crate) name: String,
    /// The GPUs it asked for (`gpu:2`), from its TRES.
    pub(crate) gpus: String,
    pub(crate) nodes: String,
    /// Its output file, with Slurm's patterns (`%j`, `%A_%a`) filled in.
    pub(crate) output: Option<PathBuf>,
    /// How often it was requeued (the next run's `SLURM_RESTART_COUNT`).
    pub(crate) restarts: u32,
    pub(crate) submitted_unix: Option<i64>,
    pub(crate) started_unix: Option<i64>,
    pub(crate) ended_unix: Option<i64>,
    /// Its exit status once ended (128 + a signal's number when killed by one).
    pub(crate) status: Option<i32>,
}

impl SlurmJob {
    /// Whether it has ended for good.
    pub(crate) fn ended(&self) -> bool {
        ENDED.contains(&self.state.as_str())
    }

    /// Its status as `jobs wait` counts it: the exit status; an end that is not
    /// Slurm's `COMPLETED` with status 0 (cancelled before it ran, a node that failed)
    /// counts as 1.
    pub(crate) fn outcome(&self) -> i32 {
        match self.status {
            Some(0) | None if self.state != "COMPLETED" => 1,
            Some(code) => code,
            None => 0,
        }
    }

    /// Its state as a line says it: `RUNNING on node3`, `PENDING (Resources)`,
    /// `FAILED (exit 3)`.
    pub(crate) fn said(&self) -> String {
        if self.ended() {
            return match self.status {
                Some(code) if code > 128 => format!("{} (signal {})", self.state, code - 128),
                Some(code) => format!("{} (exit {code})", self.state),
                None => self.state.clone(),
            };
        }
        if self.state == "RUNNING" && !self.nodes.is_empty() {
            return format!("RUNNING on {}", self.nodes);
        }
        match self.reason.as_str() {
            "" | "None" => self.state.clone(),
            why => format!("{} ({why})", self.state),
        }
    }
}

/// The jobs of `jobs` that `id` names: its array's every task (`57`), one task
/// (`57_3`, or while it waits the array's record of waiting tasks), one job.
fn named(jobs: Vec<SlurmJob>, id: &str) -> Vec<SlurmJob> {
    let (job, task) = match id.split_once('_') {
        Some((job, task)) => (job, Some(task)),
        None => (id, None),
    };
    let of_array = |j: &SlurmJob| j.array_job_id.is_some_and(|a| a.to_string() == job);
    match task {
        None => jobs
            .into_iter()
            .filter(|j| j.job_id.to_string() == job || of_array(j))
            .collect(),
        Some(task) => {
            let (exact, rest): (Vec<SlurmJob>, Vec<SlurmJob>) = jobs.into_iter().partition(|j| {
                of_array(j) && j.array_task_id.is_some_and(|t| t.to_string() == task)
            });
            if !exact.is_empty() {
                return exact;
            }
            rest.into_iter()
                .filter(|j| of_array(j) && j.array_task_id.is_none())
                .collect()
        }
    }
}

/// Whether this machine is part of a Slurm cluster: `squeue` on `PATH` and a Slurm
/// configuration (`SLURM_CONF`, else `/etc/slurm/slurm.conf`). Elsewhere, torchtools'
/// views do not ask Slurm (which would wait for a controller that is not there).
pub(crate) fn configured() -> bool {
    let conf = std::env::var_os("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/slurm/slurm.conf"));
    conf.is_file() && on_path("squeue")
}

fn on_path(program: &str) -> bool {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .any(|d| d.join(program).is_file())
}

/// `program ARGS`'s output, within [`ANSWER_WITHIN`]; the error says what it said.
fn ask(program: &str, args: &[&str]) -> Result<Vec<u8>, String> {
    let said = format!("`{program} {}`", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {said}: {e} (is Slurm's {program} on PATH?)"))?;
    // Read while it writes (a cluster's jobs can fill a pipe), on threads of their own.
    let out = child.stdout.take().map(read_all);
    let err = child.stderr.take().map(read_all);
    let Some(status) = crate::process::wait_at_most(&mut child, ANSWER_WITHIN) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!(
            "{said} did not answer within {ANSWER_WITHIN:?} (is Slurm's controller up?)"
        ));
    };
    let take = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    let (out, err) = (take(out), take(err));
    if !status.success() {
        return Err(format!(
            "{said} failed ({status}): {}",
            String::from_utf8_lossy(&err).trim()
        ));
    }
    Ok(out)
}

fn read_all(mut from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = from.read_to_end(&mut all);
        all
    })
}

/// Every job Slurm's controller knows (those waiting or running, and those ended in
/// the last `MinJobAge`, 300 s by default).
pub(crate) fn all() -> Result<Vec<SlurmJob>, String> {
    let out = ask("squeue", &["--json"])?;
    parse(&out)
}

/// The jobs `squeue --json` printed.
fn parse(out: &[u8]) -> Result<Vec<SlurmJob>, String> {
    let doc: Value = serde_json::from_slice(out)
        .map_err(|e| format!("`squeue --json` printed what is not JSON ({e})"))?;
    // A controller that does not answer: squeue exits 0 with no jobs and its errors.
    if let Some(errors) = doc
        .get("errors")
        .and_then(Value::as_array)
        .filter(|e| !e.is_empty())
    {
        let said: Vec<String> = errors
            .iter()
            .map(|e| {
                format!(
                    "{} ({}: {})",
                    string(e, "description"),
                    string(e, "source"),
                    string(e, "error")
                )
            })
            .collect();
        return Err(format!(
            "`squeue --json` said: {}: is Slurm's controller up (`scontrol ping`)?",
            tt_device::printable(&said.join("; "))
        ));
    }
    let jobs = doc
        .get("jobs")
        .and_then(Value::as_array)
        .ok_or("`squeue --json` printed no list of jobs")?;
    Ok(jobs.iter().filter_map(job_of).collect())
}

/// A number as Slurm's JSON gives it: plain (22.05), or `{"set": true, "number": N}`
/// (23.02 and later); `None` when not set.
fn number(v: Option<&Value>) -> Option<i64> {
    let v = v?;
    if let Some(n) = v.as_i64() {
        return Some(n);
    }
    match v.get("set").and_then(Value::as_bool) {
        Some(false) => None,
        _ => v.get("number").and_then(Value::as_i64),
    }
}

fn string(job: &Value, key: &str) -> String {
    match job.get(key) {
        Some(Value::String(s)) => s.clone(),
        // Later Slurms give states as a list: the first is the base state.
        Some(Value::Array(items)) => items
            .first()
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// One job of `squeue --json`'s list; `None` for what is not one.
fn job_of(job: &Value) -> Option<SlurmJob> {
    let job_id = u64::try_from(number(job.get("job_id"))?).ok()?;
    let array_job_id = number(job.get("array_job_id"))
        .and_then(|a| u64::try_from(a).ok())
        .filter(|a| *a != 0);
    let array_task_id = number(job.get("array_task_id")).and_then(|t| u64::try_from(t).ok());
    let id = match (array_job_id, array_task_id) {
        (Some(array), Some(task)) => format!("{array}_{task}"),
        (Some(array), None) => format!("{array}_[{}]", string(job, "array_task_string")),
        _ => job_id.to_string(),
    };
    let state = string(job, "job_state");
    let time = |key: &str| number(job.get(key)).filter(|t| *t > 0);
    let gpus = [
        "tres_per_node",
        "tres_per_job",
        "tres_per_task",
        "tres_per_socket",
    ]
    .iter()
    .map(|k| string(job, k))
    .find_map(|tres| {
        tres.split(',')
            .find_map(|t| {
                t.strip_prefix("gres:gpu")
                    .or_else(|| t.strip_prefix("gres/gpu"))
            })
            .map(|n| format!("gpu{n}"))
    })
    .unwrap_or_default();
    let mut j = SlurmJob {
        scheduler: "slurm",
        id,
        job_id,
        array_job_id,
        array_task_id,
        user: string(job, "user_name"),
        uid: number(job.get("user_id"))
            .and_then(|u| u32::try_from(u).ok())
            .unwrap_or(u32::MAX),
        reason: string(job, "state_reason"),
        name: string(job, "name"),
        gpus,
        nodes: string(job, "nodes"),
        output: None,
        restarts: number(job.get("restart_cnt"))
            .and_then(|r| u32::try_from(r).ok())
            .unwrap_or(0),
        submitted_unix: time("submit_time"),
        started_unix: time("start_time"),
        ended_unix: None,
        status: None,
        state,
    };
    if j.ended() {
        j.ended_unix = time("end_time");
        j.status = exit_status(job.get("exit_code"));
    }
    j.output = output_path(job, &j);
    Some(j)
}

/// An exit status as `jobs wait` gives it, from Slurm's: a wait status (22.05), or
/// `{"return_code": ..., "signal": {"id": ...}}` (later).
fn exit_status(v: Option<&Value>) -> Option<i32> {
    let v = v?;
    if let Some(w) = v.as_i64() {
        let signal = w & 0x7f;
        return i32::try_from(if signal != 0 {
            128 + signal
        } else {
            (w >> 8) & 0xff
        })
        .ok();
    }
    let signal = number(v.get("signal").and_then(|s| s.get("id"))).unwrap_or(0);
    if signal > 0 {
        return i32::try_from(128 + signal).ok();
    }
    number(v.get("return_code")).and_then(|c| i32::try_from(c).ok())
}

/// Its output file: Slurm's `standard_output` with the patterns Slurm fills in (`%j`,
/// `%A`, `%a`, `%u`, `%x`, `%N`, `%%`) filled in; relative to its working directory.
fn output_path(job: &Value, j: &SlurmJob) -> Option<PathBuf> {
    let pattern = string(job, "standard_output");
    if pattern.is_empty() {
        return None;
    }
    let mut path = String::new();
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            path.push(c);
            continue;
        }
        // Slurm's zero padding (`%4j`): digits between `%` and the letter.
        let mut width = String::new();
        let letter = loop {
            match chars.next() {
                Some(d) if d.is_ascii_digit() => width.push(d),
                other => break other,
            }
        };
        let pad = |n: String| {
            let w: usize = width.parse().unwrap_or(0);
            format!("{n:0>w$}")
        };
        match letter {
            Some('j') => path.push_str(&pad(j.job_id.to_string())),
            Some('A') => path.push_str(&pad(j.array_job_id.unwrap_or(j.job_id).to_string())),
            // The tasks not started yet have no file yet.
            Some('a') => path.push_str(&pad(j.array_task_id?.to_string())),
            Some('u') => path.push_str(&j.user),
            Some('x') => path.push_str(&j.name),
            Some('N') => path.push_str(j.nodes.split(',').next().unwrap_or_default()),
            Some('%') => path.push('%'),
            // A pattern torchtools does not fill in: the file cannot be named.
            _ => return None,
        }
    }
    let path = PathBuf::from(path);
    if path.is_absolute() {
        return Some(path);
    }
    let dir = string(job, "current_working_directory");
    (!dir.is_empty()).then(|| Path::new(&dir).join(path))
}

/// Whether `word` is written as a Slurm job id (`57`, `57_3`), or is one marked as
/// Slurm's (`slurm:57`): then the id without the mark.
pub(crate) fn slurm_id(word: &str) -> Option<(&str, bool)> {
    let (id, marked) = match word.strip_prefix("slurm:") {
        Some(id) => (id, true),
        None => (word, false),
    };
    is_slurm_id(id).then_some((id, marked))
}

/// Whether `id` is written as Slurm writes a job's id: `57`, or an array's task `57_3`
/// (as `squeue`, `scancel` and `sbatch --dependency` take it).
pub(crate) fn is_slurm_id(id: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    match id.split_once('_') {
        Some((job, task)) => digits(job) && digits(task),
        None => digits(id),
    }
}

/// What an id given to `logs`, `stop` or `jobs wait` names.
pub(crate) enum Target {
    /// torchtools' own jobs.
    Ours(Vec<Job>),
    /// Slurm's, by this id.
    Slurm(String, Vec<SlurmJob>),
}

/// The jobs `word` names: torchtools' as `ours` finds them in `records` (`resolve`:
/// an id, a unique prefix, `last`, an array's tasks; `logs` takes one job), or, on a
/// Slurm cluster, Slurm's (`57`, `57_3`, `slurm:57`). An id that names both is
/// refused, saying how to name each.
pub(crate) fn target(
    records: &Path,
    word: &str,
    ours: impl Fn(&Path, &str) -> anyhow::Result<Vec<Job>>,
) -> anyhow::Result<Target> {
    let Some((id, marked)) = slurm_id(word).filter(|_| configured()) else {
        return Ok(Target::Ours(ours(records, word)?));
    };
    if marked {
        return Ok(Target::Slurm(id.to_owned(), now(id)?));
    }
    let ours = ours(records, word);
    // A controller that does not answer does not hide a job of torchtools' own.
    let slurm = match (now(id), &ours) {
        (Ok(slurm), _) => slurm,
        (Err(_), Ok(_)) => Vec::new(),
        (Err(e), Err(_)) => return Err(e),
    };
    match (ours, slurm.is_empty()) {
        (Ok(ours), true) => Ok(Target::Ours(ours)),
        (Err(_), _) => Ok(Target::Slurm(id.to_owned(), slurm)),
        (Ok(ours), false) => Err(Exit::usage(format!(
            "{word} names torchtools' job {} and Slurm's job {id}: give torchtools' whole id, \
             or Slurm's as slurm:{id}",
            ours.first().map(|j| j.id.as_str()).unwrap_or_default()
        ))
        .into()),
    }
}

/// The jobs Slurm knows by `id` now, or an error saying what `squeue` said.
pub(crate) fn now(id: &str) -> anyhow::Result<Vec<SlurmJob>> {
    let jobs =
        all().map_err(|e| Exit::new(crate::exit::FAILURE, format!("Slurm job {id}: {e}")))?;
    Ok(named(jobs, id))
}

/// Waits until every job Slurm knows by `id` has ended (or Slurm no longer knows
/// them), asking every [`ASK_EVERY`], at most `limit`: those jobs as they ended;
/// `None` past `limit`.
pub(crate) fn wait_ended(
    id: &str,
    limit: Option<Duration>,
) -> anyhow::Result<Option<Vec<SlurmJob>>> {
    let start = Instant::now();
    let mut last = Vec::new();
    loop {
        let jobs = now(id)?;
        if jobs.iter().all(SlurmJob::ended) {
            // Tasks Slurm has forgotten are the ones last seen.
            let mut ended: Vec<SlurmJob> = last
                .into_iter()
                .filter(|j: &SlurmJob| !jobs.iter().any(|n| n.job_id == j.job_id))
                .collect();
            ended.extend(jobs);
            ended.sort_by(|a, b| a.id.cmp(&b.id));
            return Ok(Some(ended));
        }
        if limit.is_some_and(|l| start.elapsed() >= l) {
            return Ok(None);
        }
        last = jobs;
        std::thread::sleep(ASK_EVERY);
    }
}

/// Stops the Slurm job `id` for good: first made not requeueable (`scontrol update
/// JobId=ID Requeue=0`; Slurm would requeue a cancelled job, and a `--requeue`d job's
/// torchtools asks it to when its command exits 75 on the SIGTERM), then `scancel ID`
/// (SIGTERM to the job's processes, SIGKILL after the cluster's `KillWait`). The error
/// is Slurm's.
pub(crate) fn cancel(id: &str) -> anyhow::Result<()> {
    if let Err(e) = ask("scontrol", &["update", &format!("JobId={id}"), "Requeue=0"]) {
        eprintln!("torchtools: Slurm job {id} may be requeued by its torchtools: {e}");
    }
    ask("scancel", &[id]).map_err(|e| Exit::new(crate::exit::FAILURE, e))?;
    Ok(())
}

/// Every Slurm job of the user `uid` (everyone's with `all`), or why Slurm's jobs
/// could not be read; nothing off a Slurm cluster.
pub(crate) fn listed(uid: u32, all_users: bool) -> Result<Vec<SlurmJob>, String> {
    if !configured() {
        return Ok(Vec::new());
    }
    let mut jobs: Vec<SlurmJob> = all()?
        .into_iter()
        .filter(|j| all_users || j.uid == uid)
        .collect();
    jobs.sort_by_key(|j| (j.array_job_id.unwrap_or(j.job_id), j.array_task_id));
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Debian's Slurm 22.05 printed for a failed job, a running array task, the
    /// array's waiting tasks and a cancelled job (trimmed to the fields read).
    const SQUEUE: &str = r#"{"meta": {"plugin": {"type": "openapi/v0.0.38"}}, "errors": [],
      "jobs": [
        {"job_id": 1, "array_job_id": 0, "array_task_id": null, "array_task_string": "",
         "job_state": "FAILED", "state_reason": "NonZeroExitCode", "exit_code": 768,
         "name": "wrap", "user_name": "ada", "user_id": 1001,
         "standard_output": "/logs/slurm-%j.out", "tres_per_node": "gres:gpu:1",
         "nodes": "vm", "restart_cnt": 0, "start_time": 1796599532,
         "end_time": 1796599532, "submit_time": 1796599529,
         "current_working_directory": "/home/ada"},
        {"job_id": 5, "array_job_id": 4, "array_task_id": 0, "array_task_string": "",
         "job_state": "RUNNING", "state_reason": "None", "exit_code": 0,
         "name": "x UserId=root(0) JobState=COMPLETED", "user_name": "ada", "user_id": 1001,
         "standard_output": "out/slurm-%A_%a.out", "tres_per_node": "gres:gpu:1",
         "nodes": "vm", "restart_cnt": 2, "start_time": 1796599533,
         "end_time": 1828135533, "submit_time": 1796599529,
         "current_working_directory": "/home/ada"},
        {"job_id": 4, "array_job_id": 4, "array_task_id": null, "array_task_string": "1-3%1",
         "job_state": "PENDING", "state_reason": "JobArrayTaskLimit", "exit_code": 0,
         "name": "wrap", "user_name": "ada", "user_id": 1001,
         "standard_output": "/logs/slurm-%A_%a.out", "tres_per_node": "gres:gpu:1",
         "nodes": "", "restart_cnt": 0, "start_time": 0, "end_time": 0,
         "submit_time": 1796599529, "current_working_directory": "/home/ada"},
        {"job_id": 3, "job_state": ["CANCELLED"], "exit_code":
           {"status": "SIGNALED", "return_code": {"set": true, "number": 0},
            "signal": {"id": {"set": true, "number": 15}}},
         "user_name": "bob", "user_id": 1002, "standard_output": "/logs/slurm-%5j.out",
         "tres_per_job": "gres/gpu=2"}
      ]}"#;

    #[test]
    fn slurms_json_reads_as_its_jobs_states_exits_and_output_files() {
        let jobs = parse(SQUEUE.as_bytes()).unwrap();
        assert_eq!(jobs.len(), 4);
        let failed = &jobs[0];
        assert_eq!(failed.id, "1");
        assert!(failed.ended());
        assert_eq!(failed.status, Some(3));
        assert_eq!(failed.outcome(), 3);
        assert_eq!(failed.said(), "FAILED (exit 3)");
        assert_eq!(
            failed.output.as_deref(),
            Some(Path::new("/logs/slurm-1.out"))
        );
        assert_eq!(failed.gpus, "gpu:1");
        // A name that looks like fields changes nothing: JSON, not columns.
        let task = &jobs[1];
        assert_eq!(task.id, "4_0");
        assert_eq!((task.uid, task.state.as_str()), (1001, "RUNNING"));
        assert!(!task.ended());
        assert_eq!(task.status, None);
        assert_eq!(task.restarts, 2);
        assert_eq!(task.said(), "RUNNING on vm");
        assert_eq!(
            task.output.as_deref(),
            Some(Path::new("/home/ada/out/slurm-4_0.out"))
        );
        let waiting = &jobs[2];
        assert_eq!(waiting.id, "4_[1-3%1]");
        assert_eq!(waiting.said(), "PENDING (JobArrayTaskLimit)");
        assert_eq!(waiting.output, None);
        // Later Slurms' shapes: a list of states, an exit as an object.
        let cancelled = &jobs[3];
        assert_eq!(cancelled.said(), "CANCELLED (signal 15)");
        assert_eq!(cancelled.outcome(), 143);
        assert_eq!(cancelled.gpus, "gpu=2");
        assert_eq!(
            cancelled.output.as_deref(),
            Some(Path::new("/logs/slurm-00003.out"))
        );
        // The array's id names every task; a task's id names it, or while it waits
        // the array's record of waiting tasks.
        let ids = |id: &str| -> Vec<String> {
            named(jobs.clone(), id).into_iter().map(|j| j.id).collect()
        };
        assert_eq!(ids("4"), ["4_0", "4_[1-3%1]"]);
        assert_eq!(ids("4_0"), ["4_0"]);
        assert_eq!(ids("4_2"), ["4_[1-3%1]"]);
        assert_eq!(ids("5"), ["4_0"]);
        assert_eq!(ids("1"), ["1"]);
        assert!(ids("2").is_empty());
    }

    #[test]
    fn an_end_that_is_not_completed_counts_as_a_failure() {
        let mut job = parse(SQUEUE.as_bytes()).unwrap().remove(0);
        job.state = "CANCELLED".into();
        job.status = Some(0);
        assert_eq!(job.outcome(), 1);
        job.state = "COMPLETED".into();
        assert_eq!(job.outcome(), 0);
        assert!(parse(b"not json").unwrap_err().contains("not JSON"));
        assert!(parse(b"{}").unwrap_err().contains("no list of jobs"));
    }

    #[test]
    fn slurm_ids_are_numbers_tasks_or_marked() {
        assert_eq!(slurm_id("57"), Some(("57", false)));
        assert_eq!(slurm_id("57_3"), Some(("57_3", false)));
        assert_eq!(slurm_id("slurm:57"), Some(("57", true)));
        for not in ["last", "1765000000-42", "57_", "_3", "slurm:", "57_x", ""] {
            assert_eq!(slurm_id(not), None, "{not}");
        }
    }
}
