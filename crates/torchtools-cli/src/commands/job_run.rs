//! `torchtools job-run` (internal): the keeper of a detached job, as the job's
//! session leader (see the job keeper).

/// (Internal) the keeper of a detached job.
#[derive(clap::Args)]
#[command(hide = true)]
pub(crate) struct Args {
    pub(crate) id: String,
    #[arg(last = true)]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// Runs the keeper.
pub(crate) fn run(args: &Args) -> anyhow::Result<std::process::ExitCode> {
    crate::jobs::keeper::keep(&args.id, &args.command)
}
