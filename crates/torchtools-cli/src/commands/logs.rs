//! `torchtools logs`: a detached job's log.

use std::fs::File;
use std::io::Write;
use std::path::Path;
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
    let records = records_dir()?;
    let one = |records: &Path, word: &str| Ok(vec![find(records, word)?]);
    let job = match target(&records, &args.job, one)? {
        Target::Slurm(id, jobs) => return slurm_log(&id, jobs, args.follow),
        Target::Ours(jobs) => jobs.into_iter().next().ok_or_else(|| {
            Exit::usage(format!(
                "no job {:?}: `torchtools jobs` lists them",
                args.job
            ))
        })?,
    };
    let open = || {
        let file = open_log(&job.log).map_err(|e| {
            Exit::new(
                crate::exit::FAILURE,
                format!(
                    "job {}: cannot read its log {}: {e}",
                    job.id,
                    job.log.display()
                ),
            )
        })?;
        Ok(Some(file))
    };
    let ended = || {
        Ok(load(&record_path(&records, &job.id))
            .unwrap_or(job.clone())
            .ended())
    };
    copy_log(args.follow, open, ended)
}

/// Copies a log to standard output in pieces (never held whole): what it holds now,
/// and with `follow` what it gains, every [`FOLLOW_EVERY`], until `ended()` says the
/// job ended, then what was written before that. `open` gives the file, or `None`
/// while it is not there yet.
fn copy_log(
    follow: bool,
    mut open: impl FnMut() -> Result<Option<File>>,
    mut ended: impl FnMut() -> Result<bool>,
) -> Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    let mut file = None;
    loop {
        // Asked before the file is opened and copied: what the job wrote before it
        // ended is copied.
        let done = !follow || ended()?;
        if file.is_none() {
            file = open()?;
        }
        if let Some(file) = file.as_mut() {
            std::io::copy(file, &mut out)?;
            out.flush()?;
        }
        if done {
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
    let open = || {
        if follow && !path.exists() {
            return Ok(None);
        }
        let file = open_log(&path).map_err(|e| {
            Exit::new(
                crate::exit::FAILURE,
                format!(
                    "Slurm job {id}: cannot read its output {}: {e}",
                    path.display()
                ),
            )
        })?;
        Ok(Some(file))
    };
    // Slurm is asked at most every ASK_EVERY (each asking is one call to its
    // controller); the file is read more often.
    let mut asked = std::time::Instant::now();
    let ended = || {
        if asked.elapsed() < ASK_EVERY {
            return Ok(false);
        }
        asked = std::time::Instant::now();
        Ok(crate::jobs::slurm::now(id)?.iter().all(SlurmJob::ended))
    };
    copy_log(follow, open, ended)
}
