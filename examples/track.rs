//! Track resources as gpu_tracker does, from Rust: first a function of this process
//! (with two named code blocks, gpu_tracker's sub-tracking), then another command.
//! The reports are gpu_tracker's (RAM of the process and its descendants, GPU RAM, CPU
//! and GPU use, time), with the kernel's exact peaks.
//!
//! ```sh
//! cargo run --example track                     # a function, then `sh -c ...`
//! torchtools track -- python train.py           # the same for any command, no Rust
//! ```

use std::error::Error;
use std::process::Command;

use torchtools::tracker::{RamUnit, Target, TimeUnit, Tracker, TrackerConfig};

fn config() -> TrackerConfig {
    TrackerConfig {
        ram_unit: RamUnit::Megabytes,
        time_unit: TimeUnit::Seconds,
        ..TrackerConfig::default()
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }

    // A function of this process, with its blocks.
    let tracker = Tracker::start(config())?;
    let data = {
        let _block = tracker.block("load");
        vec![1u8; 50 << 20] // 50 MB
    };
    let checksum = {
        let _block = tracker.block("compute");
        data.iter().map(|&b| u64::from(b)).sum::<u64>()
    };
    drop(data);
    let usage = tracker.stop()?;
    println!("== a function of this process (checksum {checksum})\n{usage}");

    // Another command: tracked by pid, from its start to its end.
    let mut child = Command::new("sh")
        .args(["-c", "head -c 100000000 /dev/zero | tail -c 1 > /dev/null"])
        .spawn()?;
    let tracker = Tracker::start(TrackerConfig {
        target: Target::Pid(child.id()),
        ..config()
    })?;
    let status = child.wait()?;
    let usage = tracker.stop()?;
    println!("== a command ({status})\n{usage}");
    if !status.success() {
        return Err(format!("the tracked command failed: {status}").into());
    }
    Ok(())
}
