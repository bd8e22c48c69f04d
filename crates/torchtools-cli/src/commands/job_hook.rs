//! `torchtools job-hook` (internal): the guardian that runs a job's `--on-end` hook.

/// (Internal) the guardian that runs a job's `--on-end` hook.
#[derive(clap::Args)]
#[command(hide = true)]
pub(crate) struct Args {
    /// The job's id (`attached` for an attached job): for `ps`.
    pub(crate) id: String,
}

/// Runs the guardian (the id is only for `ps`; the hook comes from the job's keeper).
pub(crate) fn run(_: &Args) -> anyhow::Result<std::process::ExitCode> {
    crate::hook::guard()
}
