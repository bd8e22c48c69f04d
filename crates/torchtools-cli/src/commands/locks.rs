//! `torchtools locks`: every GPU's lock, free or held by whom.

use std::process::ExitCode;

use anyhow::Result;
use tt_lock::LockDir;

use crate::snapshot::{Gpus, Snapshot};

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

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let snapshot = Snapshot::take(&LockDir::from_env()?, &Gpus::open())?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": snapshot.lock_dir,
                "nvml": snapshot.nvml,
                "locks": snapshot.locks,
                "ignored": snapshot.ignored,
            }))?
        );
    } else {
        say(&snapshot);
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints the locks, the records not believed, a policy file ignored and the users
/// over the policy's limits.
fn say(snapshot: &Snapshot) {
    println!("GPU locks in {}", snapshot.lock_dir.display());
    if let tt_device::NvmlStatus::Unavailable { reason } = &snapshot.nvml {
        println!("  NVML unavailable ({reason}): locks are keyed by the index given (gpu-N.lock)");
    }
    if snapshot.locks.is_empty() {
        println!("  no GPU and no lock file");
    }
    for state in &snapshot.locks {
        println!("  {state}");
    }
    crate::ignored::say(&snapshot.ignored);
    if snapshot.policy_ignored {
        println!("{}", tt_device::printable(&snapshot.policy));
    }
    for line in snapshot.over_limits() {
        println!("{line}");
    }
}
