//! `torchtools devices`: the GPUs NVML sees, and which device the variables select.

use std::process::ExitCode;

/// Show the GPUs and which device a process would use.
///
/// List the GPUs (NVML) and show which device TORCHTOOLS_DEVICE, LOCAL_RANK and
/// CUDA_VISIBLE_DEVICES select.
///
/// Exits with 2 when a variable is invalid or asks for a device that is not
/// there, after printing the report.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let report = tt_device::DeviceReport::nvml_view();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    if let Some(error) = &report.error {
        eprintln!("torchtools: error: {error}");
        return Ok(ExitCode::from(crate::exit::USAGE));
    }
    Ok(ExitCode::SUCCESS)
}
