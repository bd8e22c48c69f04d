//! `torchtools run`: probe (or take --bytes), reserve, run.

use anyhow::Result;

/// Probe a command's memory, reserve GPUs, run it.
///
/// Probe, reserve, run: probe CMD in probe mode (as `probe` does) or take --bytes,
/// reserve GPU(s) leaving that much free (as `reserve` does), then run CMD for real.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("size").required(true).args(["bytes", "probe"])))]
pub(crate) struct Args {
    /// Memory the command needs, instead of probing it (`auto`: probe it, as --probe).
    #[arg(long, value_parser = crate::args::budget)]
    pub(crate) bytes: Option<crate::args::Budget>,
    /// Probe the command first and reserve the estimate.
    #[arg(long)]
    pub(crate) probe: bool,
    #[command(flatten)]
    pub(crate) probing: crate::arg_groups::ProbeArgs,
    #[command(flatten)]
    pub(crate) reservation: crate::arg_groups::ReserveArgs,
    #[command(flatten)]
    pub(crate) detach: crate::arg_groups::DetachArgs,
    #[command(flatten)]
    pub(crate) hook: crate::arg_groups::HookArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// `torchtools run` (attached; `--detach` is decided before).
pub(crate) fn run(args: &Args) -> Result<u8> {
    let limit = args.reservation.time_limit()?;
    let slurm_requeue = args.detach.slurm_requeue()?;
    let bytes = match args.bytes {
        Some(crate::args::Budget::Size(b)) => b,
        Some(crate::args::Budget::Auto) => crate::commands::probe::estimate_for_run(
            &args.reservation.gpu,
            &args.probing,
            "--bytes auto",
            &args.command,
        )?,
        None => crate::commands::probe::estimate_for_run(
            &args.reservation.gpu,
            &args.probing,
            "--probe",
            &args.command,
        )?,
    };
    crate::commands::reserve::reserve(crate::commands::reserve::Request {
        slurm_requeue,
        ..args
            .reservation
            .request(Some(bytes), args.command.clone(), limit)
    })
}
