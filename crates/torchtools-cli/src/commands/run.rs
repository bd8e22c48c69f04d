//! `torchtools run`: probe (or take --bytes), reserve, run.

use anyhow::Result;

use crate::commands::reserve::reserve_for;

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
    pub(crate) rest: crate::arg_groups::ReservingArgs,
}

/// `torchtools run` (attached; `--detach` is decided before).
pub(crate) fn run(args: &Args) -> Result<u8> {
    let rest = &args.rest;
    let asked = match args.bytes {
        Some(crate::args::Budget::Size(b)) => return reserve_for(rest, Some(b)),
        Some(crate::args::Budget::Auto) => "--bytes auto",
        None => "--probe",
    };
    let bytes = crate::commands::probe::estimate_for_run(
        &rest.reservation.gpu,
        &rest.probing,
        asked,
        &rest.command,
    )?;
    reserve_for(rest, Some(bytes))
}
