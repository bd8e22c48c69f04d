//! `torchtools run`: probe (or take --bytes), reserve, run.

use anyhow::Result;

/// `run`'s options.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Memory the command needs, instead of probing it.
    #[arg(long, value_parser = crate::args::size)]
    pub(crate) bytes: Option<tt_device::Bytes>,
    /// Probe the command first and reserve the estimate.
    #[arg(long)]
    pub(crate) probe: bool,
    /// Steps of the probe run.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) probe_steps: u64,
    /// Time limit of the probe run.
    #[arg(long, value_parser = crate::args::duration, default_value = "60s")]
    pub(crate) probe_timeout: std::time::Duration,
    #[command(flatten)]
    pub(crate) reservation: crate::reserve::ReserveArgs,
    #[command(flatten)]
    pub(crate) detach: crate::jobs::DetachArgs,
    #[command(flatten)]
    pub(crate) hook: crate::hook::HookArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// `torchtools run` (attached; `--detach` is decided before).
pub(crate) fn run(args: Args) -> Result<u8> {
    let bytes = match args.bytes {
        Some(b) => b,
        None => crate::probe::estimate_for_run(
            &args.reservation.gpu,
            args.probe_timeout,
            args.probe_steps,
            &args.command,
        )?,
    };
    crate::reserve::reserve(args.reservation.request(Some(bytes), args.command))
}
