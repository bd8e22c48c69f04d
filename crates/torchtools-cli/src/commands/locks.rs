//! `torchtools locks`: every GPU's lock, free or held by whom.

use std::process::ExitCode;

use anyhow::Result;
use tt_device::Inventory;
use tt_lock::LockDir;

/// Show every GPU's lock and who holds it.
///
/// Show every GPU's lock: free, or held by whom, since when, reserving how much,
/// and how many requests wait for it.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(args: Args) -> Result<ExitCode> {
    locks(args.json)
}

fn locks(json: bool) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let inventory = Inventory::query();
    let states = dir.status(&inventory)?;
    let ignored = dir.ignored()?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": dir.path(),
                "nvml": inventory.nvml,
                "locks": states,
                "ignored": ignored,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("GPU locks in {}", dir.path().display());
    if let tt_device::NvmlStatus::Unavailable { reason } = &inventory.nvml {
        println!("  NVML unavailable ({reason}): locks are keyed by the index given (gpu-N.lock)");
    }
    if states.is_empty() {
        println!("  no GPU and no lock file");
    }
    for state in &states {
        println!("  {state}");
    }
    crate::ignored::say(&ignored);
    crate::commands::policy::say_notes(&dir);
    Ok(ExitCode::SUCCESS)
}
