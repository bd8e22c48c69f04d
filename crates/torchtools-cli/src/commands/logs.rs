//! `torchtools logs`: a detached job's log.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;

use crate::exit::Exit;
use crate::jobs::store::{find, load, open_log, record_path, records_dir};

/// Show a detached job's log.
///
/// A detached job's log (its id, a unique prefix of it, or `last`).
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
    let job = find(&records, &args.job)?;
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
