//! `torchtools probe` and the probe stage of `torchtools run`.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tt_device::{Bytes, Inventory};
use tt_lock::GpuSpec;
use tt_probe::{probe_command, BatchSearch, CommandProbe, EstimatePolicy, ProbeError};

use crate::arg_groups::ProbeArgs;
use crate::exit::Exit;

/// Measure a command's peak memory.
///
/// Probe a command's peak memory: run it with TORCHTOOLS_PROBE=1 and
/// TORCHTOOLS_PROBE_STEPS=N (so a script can opt into a short run) until it exits or
/// the timeout, sampling its whole process tree (NVML GPU memory, else RSS), and print
/// the peak and the bytes to reserve.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Run it on this GPU only (index as nvidia-smi shows it, or UUID).
    #[arg(long, value_parser = crate::args::gpu_spec)]
    pub(crate) gpu: Option<tt_lock::GpuSpec>,
    /// Stop it after this long (its peak so far is reported): 30s, 5m.
    #[arg(long, value_parser = crate::args::duration, default_value = "60s")]
    pub(crate) timeout: std::time::Duration,
    /// Steps the command is asked to run (TORCHTOOLS_PROBE_STEPS).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) steps: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) max_batch: crate::commands::probe::MaxBatchArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// `torchtools probe` (or `probe --max-batch`).
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    if args.max_batch.max_batch {
        max_batch(args)
    } else {
        probe(args)
    }
}

/// The UUID `--gpu` names, for CUDA_VISIBLE_DEVICES (an index when there is no NVML).
fn visible(gpu: &GpuSpec, inventory: &Inventory) -> Result<Option<String>> {
    match gpu {
        GpuSpec::Auto => Ok(None),
        spec => Ok(Some(named(spec, inventory)?.cuda_visible_entry())),
    }
}

/// The GPU `spec` names, refused (exit 2) when there is none such, or when it is not
/// one of the GPUs of the Slurm job this runs in (as a reservation refuses it).
fn named(spec: &GpuSpec, inventory: &Inventory) -> Result<tt_lock::GpuKey> {
    let key = spec
        .resolve(inventory)
        .map_err(|e| Exit::usage(e.to_string()))?;
    tt_reserve::within_slurm_job(inventory, std::slice::from_ref(&key))
        .map_err(|e| Exit::usage(e.to_string()))?;
    Ok(key)
}

fn run_probe(
    gpu: Option<String>,
    timeout: Duration,
    steps: u64,
    batch: Option<u64>,
    command: &[OsString],
) -> Result<tt_probe::ProbeReport> {
    eprintln!(
        "torchtools: probing {:?} ({steps} step(s){}, at most {timeout:?})...",
        command
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
        batch.map_or(String::new(), |b| format!(" at batch {b}"))
    );
    let report = probe_command(
        &command[0],
        &command[1..],
        &CommandProbe {
            steps,
            timeout,
            gpu_uuid: gpu,
            echo_stderr: true,
            batch,
        },
    )
    .map_err(|e| match e {
        ProbeError::Spawn { .. } => Exit::new(crate::exit::NOT_FOUND, e.to_string()).into(),
        e => anyhow::Error::from(e),
    })?;
    Ok(report)
}

/// `torchtools probe`: one probe of the command's peak GPU memory.
fn probe(args: &Args) -> Result<ExitCode> {
    let (gpu, timeout, steps, json) = (&args.gpu, args.timeout, args.steps, args.json);
    let command = args.command.clone();
    let inventory = Inventory::query();
    let uuid = match &gpu {
        Some(spec) => visible(spec, &inventory)?,
        None => None,
    };
    let report = run_probe(uuid, timeout, steps, None, &command)?;
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

/// `run --probe` and `--bytes auto` (`asked`: which of them, for the messages): the
/// bytes to reserve for the command, from a probe run of it; refused (never guessed)
/// when it does not answer the probe.
pub(crate) fn estimate_for_run(
    gpus: &[GpuSpec],
    probe: &ProbeArgs,
    asked: &str,
    command: &[OsString],
) -> Result<Bytes> {
    let inventory = Inventory::query();
    // Probe on the first named GPU (all get the same reservation), or wherever CUDA
    // puts it for `auto`.
    let uuid = match gpus.first() {
        Some(spec) => visible(spec, &inventory)?,
        None => None,
    };
    let report = run_probe(uuid, probe.probe_timeout, probe.probe_steps, None, command)?;
    if report.ended_by_timeout {
        // Its peak so far may be far from the real run's: nothing is reserved from it.
        return Err(Exit::new(
            crate::exit::FAILURE,
            format!(
                "{report}.\nA script answers the probe by running TORCHTOOLS_PROBE_STEPS \
                 steps when TORCHTOOLS_PROBE=1 and exiting (without saving or logging): see \
                 the README's Python section; or give --bytes SIZE instead of {asked}"
            ),
        )
        .into());
    }
    let estimate = report.estimate(&EstimatePolicy::default());
    eprintln!("torchtools: {report}; reserving {estimate} ({asked})");
    Ok(estimate)
}

/// `probe --max-batch`: the largest batch that fits, from at most three probes.
fn max_batch(all: &Args) -> Result<ExitCode> {
    let (gpu, timeout, steps, json) = (&all.gpu, all.timeout, all.steps, all.json);
    let (args, command) = (&all.max_batch, all.command.clone());
    let inventory = Inventory::query();
    // One GPU for every probe, so that the capacity is that GPU's: --gpu's, else the
    // first NVML lists (of the Slurm job's GPUs, inside one).
    let gpu_info = match &gpu {
        Some(spec) if *spec != GpuSpec::Auto => Some(named(spec, &inventory)?),
        _ => tt_reserve::within_slurm_job(&inventory, &[])
            .map_err(|e| Exit::usage(e.to_string()))?
            .gpus
            .first()
            .map(|g| tt_lock::GpuKey::of_uuid(&g.uuid)),
    };
    let uuid = gpu_info.as_ref().map(|k| k.cuda_visible_entry());
    let (capacity, of_what) = match (args.capacity, &gpu_info) {
        (Some(c), _) => (c, "--capacity".to_owned()),
        (None, Some(key)) => {
            let free = inventory
                .gpus
                .iter()
                .find(|g| tt_lock::GpuKey::of_uuid(&g.uuid) == *key)
                .map(|g| g.free)
                .ok_or_else(|| {
                    Exit::usage(format!(
                        "NVML does not report the free memory of {key}: give --capacity"
                    ))
                })?;
            (free, format!("free memory of {key}"))
        }
        (None, None) => {
            let available = tt_tracker::process::available_memory().ok_or_else(|| {
                Exit::usage(
                    "cannot read the available memory (/proc/meminfo): give --capacity".to_owned(),
                )
            })?;
            (
                Bytes(available),
                "available system memory (no GPU)".to_owned(),
            )
        }
    };
    eprintln!("torchtools: capacity {capacity} ({of_what})");
    let search = BatchSearch {
        capacity,
        start: args.batch_start,
        policy: EstimatePolicy::default(),
        limit: args.batch_limit,
    };
    let found = tt_probe::max_batch(&search, |batch| {
        run_probe(uuid.clone(), timeout, steps, Some(batch), &command).map_err(|e| match e
            .downcast::<ProbeError>()
        {
            Ok(p) => p,
            Err(other) => ProbeError::Spawn {
                what: "the command".into(),
                reason: format!("{other:#}"),
            },
        })
    });
    let found = match found {
        Ok(f) => f,
        Err(e @ ProbeError::NoBatchGrowth { .. }) => {
            return Err(Exit::new(crate::exit::FAILURE, e.to_string()).into())
        }
        Err(e @ ProbeError::Spawn { .. }) => {
            return Err(Exit::new(crate::exit::NOT_FOUND, e.to_string()).into())
        }
        Err(e) => return Err(e.into()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&found)?);
    } else {
        println!("{found}");
        println!("max batch: {}", found.batch);
    }
    Ok(ExitCode::SUCCESS)
}

/// `probe --max-batch` and its options.
#[derive(clap::Args)]
pub(crate) struct MaxBatchArgs {
    /// Predict the largest batch that fits instead: probe the command at up to three
    /// batch sizes (TORCHTOOLS_PROBE_BATCH), fit memory as a line in the batch, and
    /// solve it for --capacity, leaving a reservation's headroom (3% + 32 MiB).
    #[arg(long)]
    pub(crate) max_batch: bool,
    /// The first probe's batch (the second runs at twice it).
    #[arg(long, default_value_t = 2, requires = "max_batch", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) batch_start: u64,
    /// Never predict more than this batch (e.g. the dataset's size).
    #[arg(long, requires = "max_batch", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) batch_limit: Option<u64>,
    /// The memory the run may use (default: the probed GPU's free memory now; without
    /// a GPU, the system's available memory).
    #[arg(long, requires = "max_batch", value_parser = crate::args::size)]
    pub(crate) capacity: Option<tt_device::Bytes>,
}
