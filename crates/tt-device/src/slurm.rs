//! The Slurm job a process runs in, read from the variables Slurm sets in it: its id
//! (an array task's as `JOB_TASK`) and the GPUs Slurm allocated to it, by the node's
//! own indices.
//!
//! Slurm gives a job's GPUs twice: `SLURM_STEP_GPUS` (in a step, under `srun`) or
//! `SLURM_JOB_GPUS` (in the batch script) hold the node's indices, the order of
//! `gres.conf`, which NVML's order matches where `AutoDetect=nvml` (or files listed by
//! minor number, as usual); `CUDA_VISIBLE_DEVICES` holds the same indices, or `0..N`
//! relative to the job where device cgroups (`ConstrainDevices=yes`) hide the rest.
//! The node's indices are the ones that name a GPU to another job on the same node, so
//! they are the bound here; `CUDA_VISIBLE_DEVICES` is left to CUDA.

/// `SLURM_JOB_ID`: set in every Slurm job.
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
/// `SLURM_STEP_GPUS`: the node's indices of the step's GPUs (under `srun`).
pub const SLURM_STEP_GPUS: &str = "SLURM_STEP_GPUS";
/// `SLURM_JOB_GPUS`: the node's indices of the job's GPUs (in the batch script).
pub const SLURM_JOB_GPUS: &str = "SLURM_JOB_GPUS";

/// The Slurm job this process runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmJob {
    /// The job's id as `squeue` and `scancel` take it: `SLURM_JOB_ID`, or for an array
    /// task `SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID` (`1234_7`).
    pub id: String,
    /// The GPUs Slurm allocated, when it allocated GPUs (`--gres=gpu:N`, `--gpus`).
    pub gpus: Option<SlurmGpus>,
}

/// The GPUs of a Slurm job or step, by the node's indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmGpus {
    /// The node's indices, in Slurm's order.
    pub indices: Vec<u32>,
    /// The variable they were read from ([`SLURM_STEP_GPUS`] or [`SLURM_JOB_GPUS`]).
    pub from: &'static str,
}

impl SlurmGpus {
    /// Whether the node's GPU `index` is one of them.
    pub fn contains(&self, index: u32) -> bool {
        self.indices.contains(&index)
    }

    /// `SLURM_STEP_GPUS=0,1`, as errors say it.
    pub fn said(&self) -> String {
        let list: Vec<String> = self.indices.iter().map(u32::to_string).collect();
        format!("{}={}", self.from, list.join(","))
    }
}

/// A Slurm variable that does not say what Slurm writes there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not {wants}: unset it, or run inside the Slurm job that set it")]
pub struct SlurmError {
    /// The variable.
    pub name: &'static str,
    /// What it holds.
    pub value: String,
    /// What Slurm writes there.
    pub wants: &'static str,
}

/// What a GPU list variable holds, as errors say it.
const GPU_LIST: &str = "a list of GPU indices (Slurm writes `0,1`)";

/// `SLURM_CPUS_PER_TASK`: the CPUs of each task (`-c N`), under `srun` and in a batch
/// script submitted with `-c`.
pub const SLURM_CPUS_PER_TASK: &str = "SLURM_CPUS_PER_TASK";
/// `SLURM_CPUS_ON_NODE`: the CPUs the job has on this node.
pub const SLURM_CPUS_ON_NODE: &str = "SLURM_CPUS_ON_NODE";

/// The CPUs Slurm gave the Slurm job of this process (`None` outside Slurm): a task's
/// (`SLURM_CPUS_PER_TASK`), else the job's on this node (`SLURM_CPUS_ON_NODE`), with
/// the variable read; an error for a value that is not a count.
///
/// ```
/// let env = |name: &str| match name {
///     "SLURM_JOB_ID" => Some("41".to_owned()),
///     "SLURM_CPUS_ON_NODE" => Some("8".to_owned()),
///     "SLURM_CPUS_PER_TASK" => Some("2".to_owned()),
///     _ => None,
/// };
/// assert_eq!(tt_device::slurm_cpus(env)?, Some((2, "SLURM_CPUS_PER_TASK")));
/// # Ok::<(), tt_device::SlurmError>(())
/// ```
pub fn slurm_cpus(
    get: impl Fn(&str) -> Option<String>,
) -> Result<Option<(usize, &'static str)>, SlurmError> {
    if job_id(&get).is_none() {
        return Ok(None);
    }
    let Some((name, value)) = [SLURM_CPUS_PER_TASK, SLURM_CPUS_ON_NODE]
        .into_iter()
        .find_map(|name| get(name).map(|value| (name, value)))
    else {
        return Ok(None);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some((n, name))),
        _ => Err(SlurmError {
            name,
            value,
            wants: "a number of CPUs (Slurm writes `4`)",
        }),
    }
}

impl SlurmJob {
    /// The Slurm job of this process, from its environment; `None` outside Slurm.
    pub fn from_env() -> Result<Option<SlurmJob>, SlurmError> {
        SlurmJob::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`SlurmJob::from_env`], the variables read through `get`.
    ///
    /// ```
    /// use tt_device::SlurmJob;
    /// let env = |name: &str| match name {
    ///     "SLURM_JOB_ID" => Some("1240".to_owned()),
    ///     "SLURM_ARRAY_JOB_ID" => Some("1234".to_owned()),
    ///     "SLURM_ARRAY_TASK_ID" => Some("6".to_owned()),
    ///     "SLURM_JOB_GPUS" => Some("0,1,2,3".to_owned()),
    ///     "SLURM_STEP_GPUS" => Some("2,3".to_owned()),
    ///     _ => None,
    /// };
    /// let job = SlurmJob::from_lookup(env)?.expect("inside a job");
    /// assert_eq!(job.id, "1234_6");
    /// let gpus = job.gpus.expect("GPUs allocated");
    /// assert_eq!(gpus.indices, [2, 3]);
    /// assert_eq!(gpus.said(), "SLURM_STEP_GPUS=2,3");
    /// # Ok::<(), tt_device::SlurmError>(())
    /// ```
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<SlurmJob>, SlurmError> {
        let Some(id) = job_id(&get) else {
            return Ok(None);
        };
        let gpus = [SLURM_STEP_GPUS, SLURM_JOB_GPUS]
            .into_iter()
            .find_map(|name| get(name).map(|value| (name, value)))
            .map(|(name, value)| parse_indices(name, &value))
            .transpose()?;
        Ok(Some(SlurmJob { id, gpus }))
    }
}

/// `SLURM_RESTART_COUNT`: how many times Slurm requeued the job (absent on its first run).
pub const SLURM_RESTART_COUNT: &str = "SLURM_RESTART_COUNT";

/// How many times Slurm has requeued the job this process runs in
/// ([`SLURM_RESTART_COUNT`]): 0 on its first run, and outside Slurm.
pub fn slurm_restart_count() -> u32 {
    std::env::var(SLURM_RESTART_COUNT)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Puts the Slurm job `id` (`1234`, or `1234_7` for an array task) back into Slurm's
/// queue with `scontrol requeue`, as Lightning does on Slurm's warning signal: Slurm
/// then ends its processes and runs it again, with [`SLURM_RESTART_COUNT`] one higher.
/// The job must have been submitted requeueable (`sbatch --requeue`, or the cluster's
/// `JobRequeue=1`). A job made not requeueable since (`torchtools stop` does so before
/// its `scancel`: Slurm would requeue a cancelled job) is not put back, and the error
/// says so; otherwise the error says what `scontrol` said.
pub fn slurm_requeue(id: &str) -> std::io::Result<()> {
    slurm_requeue_saying(id, || {})
}

/// [`slurm_requeue`], calling `say` just before `scontrol requeue` (once the job is
/// known to be requeueable): what is printed there reaches the job's output even under
/// `srun`, whose forwarding of output ends as soon as Slurm ends the job's processes.
pub fn slurm_requeue_saying(id: &str, say: impl FnOnce()) -> std::io::Result<()> {
    if slurm_job_field(id, "Requeue").as_deref() == Some("0") {
        return Err(std::io::Error::other(format!(
            "Slurm job {id} was stopped (`torchtools stop`, or `scontrol update JobId={id} \
             Requeue=0` before `scancel`): not requeued"
        )));
    }
    say();
    let out = std::process::Command::new("scontrol")
        .args(["requeue", id])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot run `scontrol requeue {id}`: {e} (is Slurm's scontrol on PATH?)"),
            )
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(std::io::Error::other(format!(
        "`scontrol requeue {id}` failed ({}): {} (was the job submitted with `sbatch \
         --requeue`?)",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// `TORCHTOOLS_REQUEUES_SLURM_JOB`: set by `torchtools reserve --requeue` and
/// `torchtools launch --requeue` inside a Slurm job, in their command's environment, to
/// the job they requeue when the command exits 75: a trainer under them only exits 75
/// ([`slurm_requeue_self_saying`]), so the job is not requeued twice.
pub const TORCHTOOLS_REQUEUES_SLURM_JOB: &str = "TORCHTOOLS_REQUEUES_SLURM_JOB";

/// What [`slurm_requeue_self_saying`] did (or left to another), so that a trainer
/// stopping on Slurm's warning can exit 75 and be run again, resuming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelfRequeue {
    /// Not inside a Slurm job: nothing to requeue (exit 75; `torchtools run --detach
    /// --requeue` runs a job that exits 75 again).
    NotInSlurm,
    /// `torchtools reserve --requeue` or `launch --requeue` runs this process and
    /// requeues the job when it exits 75 ([`TORCHTOOLS_REQUEUES_SLURM_JOB`]).
    ByTorchtools(String),
    /// Another task of the job requeues it: the one whose `SLURM_PROCID` (or the
    /// process group's `RANK`) is 0, as Lightning does.
    ByRankZero(String),
    /// This process requeued the job (`scontrol requeue`): Slurm ends its processes
    /// and runs it again.
    Requeued(String),
}

/// Requeues the Slurm job this process runs in, when it is the one to do so, as a
/// trainer does after checkpointing on Slurm's warning (`sbatch --requeue
/// --signal=USR1@90`) or preemption's SIGTERM, before it exits 75: the job's id is the
/// array task's for an array task (`1234_7`, requeued alone); under `torchtools reserve
/// --requeue` (or `launch --requeue`) torchtools requeues it instead, and of a job's
/// tasks only rank 0 does. `say` is called with the job's id just before `scontrol
/// requeue`, for a line in the job's output (Slurm ends the job's processes as it
/// requeues it). The errors are [`slurm_requeue`]'s.
///
/// ```no_run
/// // After the checkpoint on SIGUSR1 (`tt_train::install_signal_handlers`):
/// if let Err(e) = tt_device::slurm_requeue_self_saying(|job| eprintln!("requeuing {job}")) {
///     eprintln!("not requeued: {e}");
/// }
/// std::process::exit(75);
/// ```
pub fn slurm_requeue_self_saying(say: impl FnOnce(&str)) -> std::io::Result<SelfRequeue> {
    match who_requeues(|name| std::env::var(name).ok()) {
        SelfRequeue::Requeued(job) => {
            slurm_requeue_saying(&job, || say(&job))?;
            Ok(SelfRequeue::Requeued(job))
        }
        other => Ok(other),
    }
}

/// Who requeues this process's Slurm job: [`SelfRequeue::Requeued`] means this process
/// should.
fn who_requeues(get: impl Fn(&str) -> Option<String>) -> SelfRequeue {
    let Some(job) = job_id(&get) else {
        return SelfRequeue::NotInSlurm;
    };
    if get(TORCHTOOLS_REQUEUES_SLURM_JOB).is_some_and(|by| by.trim() == job) {
        return SelfRequeue::ByTorchtools(job);
    }
    let rank_zero = ["SLURM_PROCID", "RANK"]
        .iter()
        .filter_map(|name| get(name))
        .all(|rank| rank.trim() == "0");
    if !rank_zero {
        return SelfRequeue::ByRankZero(job);
    }
    SelfRequeue::Requeued(job)
}

/// What is said just before this process's Slurm job `job` is requeued, for its output:
/// `requeuing Slurm job 41, whose next run resumes (SLURM_RESTART_COUNT=1)`.
pub fn slurm_requeuing_said(job: &str) -> String {
    format!(
        "requeuing Slurm job {job}, whose next run resumes ({SLURM_RESTART_COUNT}={})",
        slurm_restart_count() + 1
    )
}

/// The value of `key` (`Requeue`, `JobState`, ...) in what `scontrol show job` says of
/// the Slurm job `id`; `None` when it cannot say. Read from the first `key=` after the
/// job's `UserId=`: the job's name comes before it (a name can hold words like
/// `Requeue=1`, but only the job's owner chooses them, for their own job).
fn slurm_job_field(id: &str, key: &str) -> Option<String> {
    let out = std::process::Command::new("scontrol")
        .args(["show", "job", "--oneliner", id])
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    field_in(&String::from_utf8_lossy(&out.stdout), key)
}

fn field_in(text: &str, key: &str) -> Option<String> {
    let line = text.lines().next()?;
    let after_user = &line[line.find(" UserId=")?..];
    let key = format!("{key}=");
    after_user
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key.as_str()))
        .map(str::to_owned)
}

/// The id of the Slurm job of this process (`1234`, or `1234_7` for an array task),
/// whatever its other variables hold; `None` outside Slurm.
pub fn slurm_job_id() -> Option<String> {
    job_id(&|name: &str| std::env::var(name).ok())
}

fn job_id(get: &impl Fn(&str) -> Option<String>) -> Option<String> {
    let job = get(SLURM_JOB_ID).filter(|v| !v.trim().is_empty())?;
    Some(
        match (get("SLURM_ARRAY_JOB_ID"), get("SLURM_ARRAY_TASK_ID")) {
            (Some(array), Some(task)) if !array.trim().is_empty() && !task.trim().is_empty() => {
                format!("{}_{}", array.trim(), task.trim())
            }
            _ => job.trim().to_owned(),
        },
    )
}

/// `0,1,3` (Slurm's form; `N-M` ranges too), as indices.
fn parse_indices(name: &'static str, value: &str) -> Result<SlurmGpus, SlurmError> {
    let bad = || SlurmError {
        name,
        value: value.to_owned(),
        wants: GPU_LIST,
    };
    let mut indices = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if b < a || b - a > 1024 {
                    return Err(bad());
                }
                indices.extend(a..=b);
            }
            None => indices.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(SlurmGpus {
        indices,
        from: name,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a panic is how a test reports
    use super::*;

    fn job(vars: &[(&str, &str)]) -> Result<Option<SlurmJob>, SlurmError> {
        SlurmJob::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn only_rank_zero_requeues_and_never_under_torchtools() {
        let who = |vars: &[(&str, &str)]| {
            who_requeues(|name| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        assert_eq!(who(&[]), SelfRequeue::NotInSlurm);
        let task = [
            ("SLURM_JOB_ID", "40"),
            ("SLURM_ARRAY_JOB_ID", "38"),
            ("SLURM_ARRAY_TASK_ID", "2"),
        ];
        assert_eq!(who(&task), SelfRequeue::Requeued("38_2".into()));
        let mut step = task.to_vec();
        step.extend([("SLURM_PROCID", "0"), ("RANK", "0")]);
        assert_eq!(who(&step), SelfRequeue::Requeued("38_2".into()));
        step[3] = ("SLURM_PROCID", "1");
        assert_eq!(who(&step), SelfRequeue::ByRankZero("38_2".into()));
        let ranked = [("SLURM_JOB_ID", "41"), ("RANK", "3")];
        assert_eq!(who(&ranked), SelfRequeue::ByRankZero("41".into()));
        let wrapped = [
            ("SLURM_JOB_ID", "42"),
            (TORCHTOOLS_REQUEUES_SLURM_JOB, "42"),
        ];
        assert_eq!(who(&wrapped), SelfRequeue::ByTorchtools("42".into()));
        // A variable left from another job (an `sbatch` inside a job) is not ours.
        let stale = [
            ("SLURM_JOB_ID", "43"),
            (TORCHTOOLS_REQUEUES_SLURM_JOB, "42"),
        ];
        assert_eq!(who(&stale), SelfRequeue::Requeued("43".into()));
    }

    #[test]
    fn a_jobs_fields_are_read_after_its_user() {
        let line = "JobId=3 JobName=x Requeue=1 UserId=root(0) GroupId=root(0) \
                    JobState=COMPLETING Requeue=0 WorkDir=/a Requeue=1\n";
        assert_eq!(field_in(line, "Requeue").as_deref(), Some("0"));
        assert_eq!(field_in(line, "JobState").as_deref(), Some("COMPLETING"));
        let said = "slurm_load_jobs error: Invalid job id specified";
        assert_eq!(field_in(said, "Requeue"), None);
        assert_eq!(field_in("", "Requeue"), None);
    }

    #[test]
    fn the_steps_gpus_come_before_the_jobs_and_a_bad_list_is_an_error() {
        assert_eq!(job(&[]).unwrap(), None);
        let batch = job(&[("SLURM_JOB_ID", "77"), ("SLURM_JOB_GPUS", "1,3")])
            .unwrap()
            .unwrap();
        assert_eq!(batch.id, "77");
        assert_eq!(batch.gpus.as_ref().unwrap().from, SLURM_JOB_GPUS);
        assert_eq!(batch.gpus.unwrap().indices, [1, 3]);
        let step = job(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_JOB_GPUS", "0-3"),
            ("SLURM_STEP_GPUS", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(step.gpus.unwrap().said(), "SLURM_STEP_GPUS=2");
        let ranged = job(&[("SLURM_JOB_ID", "77"), ("SLURM_JOB_GPUS", "0-2,5")])
            .unwrap()
            .unwrap();
        assert_eq!(ranged.gpus.unwrap().indices, [0, 1, 2, 5]);
        // No GPUs asked of Slurm: no bound.
        let cpu = job(&[("SLURM_JOB_ID", "78")]).unwrap().unwrap();
        assert_eq!(cpu.gpus, None);
        let err = job(&[("SLURM_JOB_ID", "77"), ("SLURM_STEP_GPUS", "gpu0")]).unwrap_err();
        assert!(
            err.to_string().contains("SLURM_STEP_GPUS=\"gpu0\""),
            "{err}"
        );
        assert!(job(&[("SLURM_JOB_ID", "77"), ("SLURM_JOB_GPUS", "3-1")]).is_err());
    }
}
