//! `torchtools jobs`: your detached jobs (every user's with `--all`), and `jobs wait`.

use std::process::ExitCode;

use anyhow::Result;
use tt_device::now_unix;
use tt_lock::LockDir;

use crate::jobs::keeper::DEPENDENCY_EVERY;
use crate::jobs::slurm::{target, SlurmJob, Target};
use crate::jobs::store::{
    all_jobs, load, record_path, records_dir, records_dir_in, resolve, rows, scan, Job,
};

/// List your detached jobs (or everyone's).
///
/// Your detached jobs (`--detach` on reserve, run, launch): id, state (waiting,
/// running, finished or failed with its status, lost when the machine rebooted),
/// how long, the command and its log. On a Slurm cluster, your Slurm jobs too (those
/// Slurm's controller still knows), from `squeue`.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct Args {
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
    /// Wait for jobs to end; exit with the worst status.
    ///
    /// Wait until these jobs have ended; exit with the worst status among them (a
    /// cancelled or lost job counts as 1).
    Wait(WaitArgs),
}

/// `jobs wait`'s arguments.
#[derive(clap::Args)]
pub(crate) struct WaitArgs {
    /// The jobs (ids, unique prefixes, or `last`; Slurm's: `57`, `57_3`, `slurm:57`).
    #[arg(
        required_unless_present = "all_mine",
        conflicts_with = "all_mine",
        add = crate::complete::jobs()
    )]
    jobs: Vec<String>,
    /// Every job of yours that has not ended yet.
    #[arg(long)]
    all_mine: bool,
}

/// `torchtools jobs` and `jobs wait`.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    match &args.wait {
        Some(JobsCommand::Wait(wait_args)) => wait(wait_args),
        None => list(args),
    }
}

/// `torchtools jobs [--all] [--json]`.
fn list(args: &Args) -> Result<ExitCode> {
    let (json, all) = (args.json, args.all);
    let locks = LockDir::from_env()?;
    let waiting: Vec<u32> = locks
        .queue()
        .map(|q| q.iter().map(|w| w.who.pid).collect())
        .unwrap_or_default();
    let held = locks.list().unwrap_or_default();
    let mine = tt_lock::euid();
    let scan = scan(&records_dir_in(&locks)?)?;
    let jobs: Vec<Job> = scan
        .jobs
        .into_iter()
        .filter(|j| all || j.uid == mine)
        .collect();
    if !json {
        crate::ignored::say(&scan.ignored);
        crate::commands::policy::say_notes(&locks);
        for why in &scan.damaged {
            println!("damaged job record (not a job torchtools wrote): {why}");
        }
    }
    let slurm = crate::jobs::slurm::listed(mine, all).unwrap_or_else(|e| {
        eprintln!("torchtools: Slurm's jobs are not shown: {e}");
        Vec::new()
    });
    if json {
        let mut rows = serde_json::to_value(rows(jobs, &waiting, &held))?;
        if let Some(rows) = rows.as_array_mut() {
            for job in &slurm {
                rows.push(serde_json::to_value(job)?);
            }
        }
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    list_slurm(&slurm);
    if jobs.is_empty() {
        if slurm.is_empty() {
            println!(
                "no job{}",
                if all {
                    ""
                } else {
                    " of yours (--all: everyone's)"
                }
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let now = now_unix();
    for job in &jobs {
        let took = job.ended_unix.unwrap_or(now) - job.since.0;
        let (gpus, bytes) = job.held_by(&held);
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
            tt_device::printable(&job.state(&waiting)),
            format!("{:.0}s", took.max(0.0)),
            gpus,
            crate::args::shown(&job.command),
            tt_device::printable(&job.log.to_string_lossy())
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Slurm's jobs, under torchtools' own: id, user, state, how long, GPUs, name and
/// output file.
fn list_slurm(jobs: &[SlurmJob]) {
    if jobs.is_empty() {
        return;
    }
    println!("Slurm's jobs (`squeue`):");
    let now = now_unix() as i64;
    for job in jobs {
        let took = job
            .started_unix
            .map(|s| format!("{}s", (job.ended_unix.unwrap_or(now) - s).max(0)))
            .unwrap_or_else(|| "-".into());
        println!(
            "{}  {:<8}  {:<24}  {:>7}  {}  {}  {}",
            tt_device::printable(&job.id),
            tt_device::printable(&job.user),
            tt_device::printable(&job.said()),
            took,
            if job.gpus.is_empty() { "-" } else { &job.gpus },
            tt_device::printable(&job.name),
            job.output
                .as_deref()
                .map_or("-".into(), |p| tt_device::printable(&p.to_string_lossy())
                    .into_owned())
        );
    }
}

/// `torchtools jobs wait`: returns when every job named has ended, with the worst
/// status (the largest), each job's end said on its line. Slurm's jobs (on a Slurm
/// cluster) are waited for by asking Slurm.
fn wait(args: &WaitArgs) -> Result<ExitCode> {
    let records = records_dir()?;
    let mut worst = 0;
    let mut slurm_ids = Vec::new();
    let ids: Vec<String> = if args.all_mine {
        // Slurm not answering leaves torchtools' jobs to wait for, and fails the wait.
        let slurms = crate::jobs::slurm::listed(tt_lock::euid(), false).unwrap_or_else(|e| {
            eprintln!("torchtools: your Slurm jobs are not waited for: {e}");
            worst = crate::exit::FAILURE.into();
            Vec::new()
        });
        for job in slurms {
            let id = job.array_job_id.unwrap_or(job.job_id).to_string();
            if !job.ended() && !slurm_ids.contains(&id) {
                slurm_ids.push(id);
            }
        }
        all_jobs(&records)?
            .into_iter()
            .filter(|j| j.uid == tt_lock::euid() && !j.ended())
            .map(|j| j.id)
            .collect()
    } else {
        let mut all = Vec::new();
        for id in &args.jobs {
            match target(&records, id, resolve)? {
                Target::Ours(jobs) => all.extend(jobs.into_iter().map(|j| j.id)),
                Target::Slurm(id, _) => slurm_ids.push(id),
            }
        }
        all
    };
    for id in &slurm_ids {
        worst = worst.max(wait_slurm(id)?);
    }
    for id in &ids {
        let job = loop {
            match load(&record_path(&records, id)) {
                Some(job) if job.ended() => break Some(job),
                Some(_) => std::thread::sleep(DEPENDENCY_EVERY),
                None => break None,
            }
        };
        let (code, said) = match &job {
            Some(job) => (job.outcome(), job.state(&[])),
            None => (1, "its record is gone".to_owned()),
        };
        println!("{id}  {said}");
        worst = worst.max(code);
    }
    Ok(ExitCode::from(u8::try_from(worst).unwrap_or(1)))
}

/// Waits for the Slurm job `id` (every task of an array) to end, saying how each
/// ended: the worst status.
fn wait_slurm(id: &str) -> Result<i32> {
    let ended = crate::jobs::slurm::wait_ended(id, None)?.unwrap_or_default();
    if ended.is_empty() {
        println!(
            "{id}  Slurm does not know it (never submitted, or ended longer ago than the \
             cluster's MinJobAge: `sacct -j {id}`)"
        );
        return Ok(1);
    }
    let mut worst = 0;
    for job in &ended {
        println!("{}  {}", tt_device::printable(&job.id), job.said());
        worst = worst.max(job.outcome());
    }
    Ok(worst)
}
