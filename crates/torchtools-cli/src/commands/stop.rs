//! `torchtools stop`: SIGTERM to a detached job, SIGKILL to all of it after `--grace`.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;

use nix::sys::signal::Signal;

use crate::exit::Exit;
use crate::jobs::slurm::{target, SlurmJob, Target};
use crate::jobs::store::{load, record_path, records_dir, resolve, Job};
use crate::process::{session_members, signal};

/// Stop a detached job.
///
/// Stop a detached job: SIGTERM to it (a torchtools trainer then checkpoints and
/// exits 75), SIGKILL to all of it after --grace. On a Slurm cluster, a Slurm job
/// (`57`, `57_3`, `slurm:57`) is stopped with `scancel`, and not requeued.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The job.
    #[arg(add = crate::complete::jobs())]
    pub(crate) job: String,
    /// How long it has to end after SIGTERM [default: 10s]. A Slurm job's is the
    /// cluster's `KillWait`.
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) grace: Option<std::time::Duration>,
}

/// How long a job has to end after SIGTERM when `--grace` does not say.
const GRACE: Duration = Duration::from_secs(10);

/// How long `stop` waits for Slurm to say a cancelled job ended.
const SLURM_ENDS_WITHIN: Duration = Duration::from_secs(120);

/// `torchtools stop ID`: the job, or every task of the array `ID` (those still
/// waiting to start first, so that none starts meanwhile).
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let records = records_dir()?;
    let mut jobs = match target(&records, &args.job, resolve)? {
        Target::Ours(jobs) => jobs,
        Target::Slurm(id, jobs) => return stop_slurm(&id, &jobs, args.grace),
    };
    jobs.sort_by_key(|j| j.pid.is_some());
    for job in jobs {
        stop_one(&records, job, args.grace.unwrap_or(GRACE))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `stop` of a Slurm job: `scancel` (SIGTERM to its processes, then SIGKILL after the
/// cluster's `KillWait`), then Slurm's word that it ended. A job stopped so is not
/// requeued by the torchtools inside it.
fn stop_slurm(id: &str, jobs: &[SlurmJob], grace: Option<Duration>) -> Result<ExitCode> {
    if grace.is_some() {
        return Err(Exit::usage(format!(
            "--grace: Slurm job {id}'s time from SIGTERM to SIGKILL is the cluster's \
             KillWait, not the job's; leave --grace out"
        ))
        .into());
    }
    if jobs.is_empty() {
        return Err(Exit::usage(format!(
            "Slurm does not know job {id}: `torchtools jobs` lists yours"
        ))
        .into());
    }
    if jobs.iter().all(SlurmJob::ended) {
        eprintln!("torchtools: Slurm job {id} has ended already");
        return Ok(ExitCode::SUCCESS);
    }
    crate::jobs::slurm::cancel(id)?;
    match crate::jobs::slurm::wait_ended(id, Some(SLURM_ENDS_WITHIN))? {
        Some(ended) => {
            for job in ended {
                eprintln!(
                    "torchtools: Slurm job {} stopped ({})",
                    tt_device::printable(&job.id),
                    job.said()
                );
            }
        }
        None => eprintln!(
            "torchtools: Slurm job {id} was cancelled but has not ended after \
             {SLURM_ENDS_WITHIN:?}: `squeue -j {id}`"
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// How often a stopping job's record is read.
const LOOK_EVERY: Duration = Duration::from_millis(100);

fn stop_one(records: &Path, job: Job, grace: Duration) -> Result<()> {
    let me = tt_lock::euid();
    if job.uid != me && me != 0 {
        return Err(Exit::new(
            crate::exit::FAILURE,
            format!(
                "job {} belongs to {} (uid {}): only they (or root) can stop it",
                job.id, job.user, job.uid
            ),
        )
        .into());
    }
    if job.ended() {
        eprintln!("torchtools: job {} has ended already", job.id);
        return Ok(());
    }
    if job.elsewhere() {
        return Err(Exit::new(
            crate::exit::FAILURE,
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
    // then checkpoints and exits 75). Past the grace period, SIGKILL to everything in
    // the job's session (its torchtools, the command, ranks in process groups of their
    // own) but its keeper, which then records the kill.
    let send = |sig: Signal| match sig {
        Signal::SIGTERM => {
            if job.alive() {
                signal(job.keeper_pid, sig);
            }
            match job.pid {
                Some(pid) if job.is_jobs(pid) => signal(pid, sig),
                Some(pid) => eprintln!(
                    "torchtools: job {}: pid {pid} is no longer its process (another \
                     user's, or started after the job): not signalled",
                    job.id
                ),
                None => {}
            }
        }
        _ if !job.alive() => eprintln!("torchtools: job {}: its keeper is gone", job.id),
        _ => {
            for pid in session_members(job.keeper_pid) {
                if pid != job.keeper_pid && job.is_jobs(pid) {
                    signal(pid, sig);
                }
            }
        }
    };
    let gone_within = |grace: Duration| {
        let deadline = Instant::now() + grace;
        loop {
            let now = load(&record_path(records, &job.id)).unwrap_or(job.clone());
            if now.ended() {
                eprintln!("torchtools: job {} stopped ({})", job.id, now.state(&[]));
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(LOOK_EVERY);
        }
    };
    crate::process::terminate(send, grace, gone_within, || {
        eprintln!(
            "torchtools: job {} still runs {grace:?} after SIGTERM: SIGKILL",
            job.id
        )
    });
    Ok(())
}
