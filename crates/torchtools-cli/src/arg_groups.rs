//! The groups of options several commands share, each defined once: the memory
//! budget (`--bytes`, `--probe`, on `run`, `reserve`, `launch`), the reservation
//! (`--gpu`, `--timeout`, ...), time limits (`--time`, `--preemptible`), `--detach`
//! and its job options, and `--on-end`. What each group does lives with the code
//! that does it (`reserve`, `limit`, the job keeper, `hook`).

use std::path::PathBuf;
use std::time::Duration;

/// How `run --probe` and `--bytes auto` probe: steps and a time limit.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ProbeArgs {
    /// Steps of the probe run (--probe, --bytes auto).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) probe_steps: u64,
    /// Time limit of the probe run (--probe, --bytes auto).
    #[arg(long, value_parser = crate::args::duration, default_value = "60s")]
    pub(crate) probe_timeout: Duration,
}

/// How `reserve` and `run` reserve: everything but the bytes and the command.
/// What `reserve` and `run` both take after their memory option: how to probe, what to
/// reserve, whether to detach, the hook, and the command after `--`.
#[derive(clap::Args)]
pub(crate) struct ReservingArgs {
    #[command(flatten)]
    pub(crate) probing: ProbeArgs,
    #[command(flatten)]
    pub(crate) reservation: ReserveArgs,
    #[command(flatten)]
    pub(crate) detach: DetachArgs,
    #[command(flatten)]
    pub(crate) hook: HookArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<std::ffi::OsString>,
}

#[derive(clap::Args)]
pub(crate) struct ReserveArgs {
    /// The GPU(s): an index as nvidia-smi shows it, a UUID (GPU-..., a prefix is
    /// enough), or auto (the free GPU(s) with the most free memory). Repeat or
    /// separate with commas for several.
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = crate::args::gpu_spec, add = crate::complete::gpus())]
    pub(crate) gpu: Vec<tt_lock::GpuSpec>,
    /// How many GPUs --gpu auto takes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) count: Option<u32>,
    /// Extra memory left free on top of the bytes.
    #[arg(long, value_parser = crate::args::size, default_value = DEFAULT_MARGIN)]
    pub(crate) margin: tt_device::Bytes,
    /// Take the lock alone, without a memory fence (works without a GPU).
    #[arg(long)]
    pub(crate) no_fence: bool,
    /// Share one GPU with other jobs by memory budget instead of taking it alone:
    /// --bytes is this job's budget, granted (in the same queue) when it fits beside the
    /// other sharers' budgets within the GPU's memory; a job that asks for the GPU
    /// alone waits for every sharer to leave. The memory no sharer budgeted is fenced
    /// (--no-fence: not); PyTorch's allocator in the command is capped at the budget
    /// (PYTORCH_CUDA_ALLOC_CONF).
    #[arg(long)]
    pub(crate) share: bool,
    /// With --share: leave PYTORCH_CUDA_ALLOC_CONF alone (for a PyTorch too old to know
    /// its per_process_memory_fraction option, which it refuses); the command reads its
    /// share from TORCHTOOLS_SHARE_FRACTION instead.
    #[arg(long, requires = "share")]
    pub(crate) no_cap: bool,
    /// Give up (exit 75) when the GPUs are still locked after this long: 30s, 10m,
    /// 1h. Default: wait as long as it takes.
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) timeout: Option<std::time::Duration>,
    #[command(flatten)]
    pub(crate) time: crate::arg_groups::TimeArgs,
}

/// The time-limit options.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct TimeArgs {
    /// End the command after this long (30m, 8h, 2d): SIGTERM (a torchtools trainer
    /// then checkpoints and exits 75), SIGKILL after --grace. Counted from the
    /// command's start, once the GPUs are held. Default: the machine policy's
    /// time_default (`torchtools policy`), else no limit; at most its time_max.
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) time: Option<Duration>,
    /// From the time limit's SIGTERM to SIGKILL [default: 60s].
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) grace: Option<Duration>,
    /// Send SIGUSR1 this long before the time limit, for a script that checkpoints
    /// on its own signal.
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) signal_before: Option<Duration>,
    /// Let the machine's policy preempt the job (its `[preemption]`, `torchtools policy`):
    /// when a request of a user below their fair share has waited long enough for its
    /// GPU, the job gets SIGTERM (a torchtools trainer checkpoints and exits 75) and,
    /// detached, goes back into the queue (--preemptible implies --requeue).
    #[arg(long)]
    pub(crate) preemptible: bool,
}

/// `--detach` and `--log-dir`, on `reserve`, `run` and `launch`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct DetachArgs {
    /// Start the command in a session of its own, immune to the terminal's hang-up and
    /// to logging out, with its output in a log file; print its job id at once (see
    /// `torchtools jobs`, `logs`, `stop`).
    #[arg(long)]
    pub(crate) detach: bool,
    /// Where a detached job's log goes (default: $XDG_STATE_HOME/torchtools/logs, or
    /// ~/.local/state/torchtools/logs).
    #[arg(long, value_name = "DIR", requires = "detach")]
    pub(crate) log_dir: Option<PathBuf>,
    /// Start only after these jobs have ended, however they ended (ids, unique
    /// prefixes or `last`; comma-separated or repeated). Meanwhile `jobs` says
    /// "waiting for job ID", and the job takes its place in the GPU queue only then.
    #[arg(long, value_name = "JOB", value_delimiter = ',', requires = "detach", add = crate::complete::jobs())]
    pub(crate) after: Vec<String>,
    /// Start only after these jobs have ended, and only if every one succeeded (exit
    /// 0); otherwise the job ends as "cancelled: job ID failed" without running.
    #[arg(long, value_name = "JOB", value_delimiter = ',', requires = "detach", add = crate::complete::jobs())]
    pub(crate) after_ok: Vec<String>,
    /// When the job exits 75 (its time limit, preemption, or its own choice: a
    /// torchtools trainer checkpoints on SIGTERM and exits 75), put it back in the
    /// queue and run the same command again, which resumes from its checkpoint.
    /// `torchtools stop` ends it for good. `jobs` shows how many times it ran. Inside
    /// a Slurm job (`sbatch --requeue`), without --detach: Slurm's queue, with
    /// `scontrol requeue`.
    #[arg(long)]
    pub(crate) requeue: bool,
    /// Start one job per index (0-9, 1,4,7, or 0-99%4: at most 4 at once), each with
    /// TORCHTOOLS_ARRAY_TASK_ID set to its index; the array's id is printed (`stop` and
    /// `jobs wait` take it for every task, ID_N for one).
    #[arg(long, value_name = "INDICES", value_parser = crate::args::array, requires = "detach")]
    pub(crate) array: Option<crate::args::ArraySpec>,
    /// Submit the job to Slurm with `sbatch` instead of torchtools' queue: --count,
    /// --time, --requeue (with Slurm's warning signal), --array, --after and --after-ok
    /// become the script's options, and the same command runs inside the job on its
    /// GPUs. What Slurm cannot be asked for is refused first. `[detach] to = "slurm"`
    /// in your config.toml makes it the default.
    #[arg(long, requires = "detach", conflicts_with = "no_slurm")]
    pub(crate) slurm: bool,
    /// To torchtools' own queue, whatever your config.toml's `[detach] to` says.
    #[arg(long, requires = "detach")]
    pub(crate) no_slurm: bool,
    /// With --slurm: print the `sbatch` script instead of submitting it.
    #[arg(long, requires = "detach")]
    pub(crate) dry_run: bool,
}

impl DetachArgs {
    /// Whether the job goes to Slurm: `--slurm`, `--no-slurm`, else the user's
    /// config's `[detach] to`, else the machine policy's; `--dry-run` only with Slurm.
    pub(crate) fn to_slurm(&self) -> anyhow::Result<bool> {
        let slurm = match (self.slurm, self.no_slurm) {
            (true, _) => true,
            (false, true) => false,
            (false, false) => match crate::config::detach_to()? {
                (tt_lock::Scheduler::Slurm, Some(file)) => {
                    eprintln!(
                        "torchtools: to Slurm, as {} says (`[detach] to = \"slurm\"`; \
                         --no-slurm keeps a job on this machine)",
                        file.display()
                    );
                    true
                }
                (to, _) => to == tt_lock::Scheduler::Slurm,
            },
        };
        if self.dry_run && !slurm {
            return Err(crate::exit::Exit::usage(
                "--dry-run prints the `sbatch` script of a job submitted to Slurm: add \
                 --slurm (or `[detach] to = \"slurm\"` in your config.toml)"
                    .into(),
            )
            .into());
        }
        Ok(slurm)
    }

    /// For a command run attached: the Slurm job to requeue when it exits 75
    /// (`--requeue` inside a Slurm job); `--requeue` elsewhere needs `--detach`.
    pub(crate) fn slurm_requeue(&self) -> anyhow::Result<Option<String>> {
        if !self.requeue || self.detach {
            return Ok(None);
        }
        match tt_device::slurm_job_id() {
            Some(job) => Ok(Some(job)),
            None => Err(crate::exit::Exit::usage(
                "--requeue runs the command again when it exits 75: give --detach too \
                 (torchtools' queue requeues a detached job), or run it in a Slurm job \
                 submitted with `sbatch --requeue` (Slurm requeues it)"
                    .into(),
            )
            .into()),
        }
    }
}

/// `--on-end`, `--no-on-end` and `--on-end-timeout`, on `reserve`, `run` and `launch`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct HookArgs {
    /// Run CMD (with `sh -c`) once when the job ends, however it ends: exit, signal,
    /// `stop`, cancelled, or lost (torchtools or the job's keeper killed). It gets
    /// TORCHTOOLS_JOB_ID, _COMMAND, _USER, _HOST, _GPUS, _STATUS, _STATE, _STARTED,
    /// _ENDED, _SECONDS and _LOG, and the log's last 50 lines on standard input
    /// (detached jobs). A hook that fails or overruns is a warning; the job's status
    /// never changes. Default: `[on_end] command` of
    /// $XDG_CONFIG_HOME/torchtools/config.toml.
    #[arg(long, value_name = "CMD")]
    pub(crate) on_end: Option<String>,
    /// Run no hook for this job, not even the config's default.
    #[arg(long, conflicts_with = "on_end")]
    pub(crate) no_on_end: bool,
    /// How long the hook may run before it is killed (default: the config's
    /// `[on_end] timeout`, else 60s).
    #[arg(long, value_name = "TIME", value_parser = crate::args::duration)]
    pub(crate) on_end_timeout: Option<Duration>,
}

/// `--margin`'s default: tt-fence's `DEFAULT_SAFETY_MARGIN` (a test checks they agree).
pub(crate) const DEFAULT_MARGIN: &str = "50MiB";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_margin_is_tt_fences() {
        assert_eq!(
            crate::args::size(DEFAULT_MARGIN),
            Ok(tt_fence::DEFAULT_SAFETY_MARGIN)
        );
    }
}
