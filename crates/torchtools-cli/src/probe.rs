//! `torchtools probe` and the probe stage of `torchtools run`.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tt_device::{Bytes, Inventory};
use tt_lock::GpuSpec;
use tt_probe::{probe_command, CommandProbe, EstimatePolicy, ProbeError};

use crate::child::Exit;

/// The UUID `--gpu` names, for CUDA_VISIBLE_DEVICES (an index when there is no NVML).
fn visible(gpu: &GpuSpec, inventory: &Inventory) -> Result<Option<String>> {
    match gpu {
        GpuSpec::Auto => Ok(None),
        spec => match spec.resolve(inventory) {
            Ok(key) => Ok(Some(key.cuda_visible_entry())),
            Err(e) => Err(Exit(2, e.to_string()).into()),
        },
    }
}

fn run_probe(
    gpu: Option<String>,
    timeout: Duration,
    steps: u64,
    command: &[OsString],
) -> Result<tt_probe::ProbeReport> {
    eprintln!(
        "torchtools: probing {:?} ({steps} step(s), at most {timeout:?})...",
        command
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let report = probe_command(
        &command[0],
        &command[1..],
        &CommandProbe {
            steps,
            timeout,
            gpu_uuid: gpu,
            echo_stderr: true,
        },
    )
    .map_err(|e| match e {
        ProbeError::Spawn { .. } => Exit(127, e.to_string()).into(),
        e => anyhow::Error::from(e),
    })?;
    Ok(report)
}

pub(crate) fn probe(
    gpu: Option<GpuSpec>,
    timeout: Duration,
    steps: u64,
    json: bool,
    command: Vec<OsString>,
) -> Result<ExitCode> {
    let inventory = Inventory::query();
    let uuid = match &gpu {
        Some(spec) => visible(spec, &inventory)?,
        None => None,
    };
    let report = run_probe(uuid, timeout, steps, &command)?;
    let estimate = report.estimate(&EstimatePolicy::default());
    if json {
        let mut value = serde_json::to_value(&report)?;
        value["estimate"] = serde_json::json!(estimate);
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("{report}");
        println!("estimate: reserve {estimate} ({} bytes)", estimate.0);
    }
    Ok(ExitCode::SUCCESS)
}

/// `run --probe`: the bytes to reserve for the command.
pub(crate) fn estimate_for_run(
    gpus: &[GpuSpec],
    timeout: Duration,
    steps: u64,
    command: &[OsString],
) -> Result<Bytes> {
    let inventory = Inventory::query();
    // Probe on the first named GPU (all get the same reservation), or wherever CUDA
    // puts it for `auto`.
    let uuid = match gpus.first() {
        Some(spec) => visible(spec, &inventory)?,
        None => None,
    };
    let report = run_probe(uuid, timeout, steps, command)?;
    let estimate = report.estimate(&EstimatePolicy::default());
    eprintln!("torchtools: {report}; reserving {estimate}");
    Ok(estimate)
}
