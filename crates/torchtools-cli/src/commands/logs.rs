//! `torchtools logs`: a detached job's log.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;

use crate::exit::Exit;
use crate::jobs::slurm::{target, SlurmJob, Target, ASK_EVERY};
use crate::jobs::store::{find, load, open_log, record_path, records_dir};

/// Show a detached job's log.
///
/// A detached job's log (its id, a unique prefix of it, or `last`); on a Slurm
/// cluster, a Slurm job's output file (`57`, an array's task `57_3`).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The job.
    #[arg(add = crate::complete::jobs())]
    pub(crate) job: String,
    /// Follow the log while the job runs; end when it ends.
    #[arg(short, long)]
    pub(crate) follow: bool,
}

/// `torchtools logs`: the log copied out, and with `--follow` on until the job ends.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let follow = args.follow;
    let records = records_dir()?;
    let job = match target(&records, &args.job)? {
        Target::Slurm(id, jobs) => return slurm_log(&id, jobs, follow),
        Target::Ours(_) => find(&records, &args.job)?,
    };
    let mut file = open_log(&job.log).map_err(|e| {
        Exit::new(
            crate::exit::FAILURE,
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
        if now.ended() {
            // The rest written before it ended.
            std::io::copy(&mut file, &mut out)?;
            out.flush()?;
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(FOLLOW_EVERY);
    }
}

/// How often `--follow` reads the log again.
const FOLLOW_EVERY: Duration = Duration::from_millis(200);

/// A Slurm job's output file (Slurm's `--output`), copied out; with `follow`, on
/// until Slurm says the job ended. A job Slurm no longer knows is looked for where
/// `--slurm` puts its output (`slurm-ID.out` in the default log directory).
fn slurm_log(id: &str, jobs: Vec<SlurmJob>, follow: bool) -> Result<ExitCode> {
    let path = match jobs.as_slice() {
        [] => {
            let path = crate::jobs::keeper::default_log_dir()?.join(format!("slurm-{id}.out"));
            if !path.is_file() {
                return Err(Exit::usage(format!(
                    "Slurm does not know job {id} (ended longer ago than the cluster's \
                     MinJobAge, or never submitted), and {} is not there: its output is \
                     where its `--output` said",
                    path.display()
                ))
                .into());
            }
            path
        }
        [job] => job.output.clone().ok_or_else(|| {
            Exit::new(
                crate::exit::FAILURE,
                format!("Slurm job {}: no output file yet ({})", job.id, job.said()),
            )
        })?,
        many => {
            let ids: Vec<&str> = many.iter().map(|j| j.id.as_str()).collect();
            return Err(Exit::usage(format!(
                "Slurm job {id} is an array of several tasks ({}): name one, like {}",
                ids.join(", "),
                ids[0]
            ))
            .into());
        }
    };
    let said = |e: std::io::Error| {
        Exit::new(
            crate::exit::FAILURE,
            format!(
                "Slurm job {id}: cannot read its output {}: {e}",
                path.display()
            ),
        )
    };
    let mut out = std::io::stdout().lock();
    let mut file = None;
    let mut asked = std::time::Instant::now();
    loop {
        if file.is_none() && (!follow || path.exists()) {
            file = Some(open_log(&path).map_err(said)?);
        }
        if let Some(file) = file.as_mut() {
            std::io::copy(file, &mut out)?;
            out.flush()?;
        }
        if !follow {
            return Ok(ExitCode::SUCCESS);
        }
        if asked.elapsed() >= ASK_EVERY {
            asked = std::time::Instant::now();
            let now = crate::jobs::slurm::now(id)?;
            if now.iter().all(SlurmJob::ended) {
                if let Some(file) = file.as_mut() {
                    std::io::copy(file, &mut out)?;
                    out.flush()?;
                }
                return Ok(ExitCode::SUCCESS);
            }
        }
        std::thread::sleep(FOLLOW_EVERY);
    }
}
