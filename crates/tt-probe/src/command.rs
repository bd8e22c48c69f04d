use std::ffi::OsString;
use std::process::Command;
use std::time::Duration;

use tt_device::Bytes;

use crate::child::{self, Ended, Options};
use crate::{MemoryKind, ProbeError, ProbeReport, Result};

/// The variable a probed command finds set to `1`: run a short probe, not the whole job.
pub const PROBE_ENV: &str = "TORCHTOOLS_PROBE";
/// The variable that tells a probed command how many steps to run.
pub const PROBE_STEPS_ENV: &str = "TORCHTOOLS_PROBE_STEPS";

/// How to probe a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandProbe {
    /// Steps the command is asked to run (`TORCHTOOLS_PROBE_STEPS`); default 5.
    pub steps: u64,
    /// The command is stopped after this long (default 60 s, as the Python torchtools' probe); its peak so
    /// far is reported, marked `ended_by_timeout`.
    pub timeout: Duration,
    /// Run it on this GPU only (`CUDA_VISIBLE_DEVICES=<uuid>`).
    pub gpu_uuid: Option<String>,
    /// Copy the command's stderr to ours as it comes (its last 8 KiB are kept anyway).
    pub echo_stderr: bool,
    /// The batch size the command is asked to use ([`crate::PROBE_BATCH_ENV`]), for
    /// [`crate::max_batch`]; `None` leaves the variable unset.
    pub batch: Option<u64>,
}

impl Default for CommandProbe {
    fn default() -> Self {
        CommandProbe {
            steps: 5,
            timeout: Duration::from_secs(60),
            gpu_uuid: None,
            echo_stderr: false,
            batch: None,
        }
    }
}

/// Turns a child's end into an error, if it failed.
pub(crate) fn failure(ended: &Ended) -> Option<ProbeError> {
    let stderr_tail = ended.stderr_tail.clone();
    match (ended.code, ended.signal) {
        (Some(0), _) => None,
        (Some(code), _) => Some(ProbeError::Failed { code, stderr_tail }),
        (None, Some(signal)) => Some(ProbeError::Crashed {
            signal,
            hint: if signal == libc::SIGKILL {
                " (SIGKILL: the kernel's OOM killer?)".into()
            } else {
                String::new()
            },
            stderr_tail,
        }),
        (None, None) => Some(ProbeError::Failed {
            code: -1,
            stderr_tail,
        }),
    }
}

/// Runs `program args...` with `TORCHTOOLS_PROBE=1` and `TORCHTOOLS_PROBE_STEPS=N` in its
/// environment, until it exits or the timeout ends it, sampling its whole process tree:
/// NVML per-process GPU memory (every 20 ms), and RSS (the kernel's high-water marks).
/// A Python training script can opt into a short run by reading those variables.
pub fn probe_command(
    program: &OsString,
    args: &[OsString],
    opts: &CommandProbe,
) -> Result<ProbeReport> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env(PROBE_ENV, "1")
        .env(PROBE_STEPS_ENV, opts.steps.to_string());
    if let Some(uuid) = &opts.gpu_uuid {
        cmd.env("CUDA_VISIBLE_DEVICES", uuid);
    }
    if let Some(batch) = opts.batch {
        cmd.env(crate::PROBE_BATCH_ENV, batch.to_string());
    }
    let ended = child::run(
        cmd,
        &program.to_string_lossy(),
        &Options {
            timeout: opts.timeout,
            report_pipe: false,
            echo_stderr: opts.echo_stderr,
            quiet_stdout: false,
        },
    )?;
    if !ended.timed_out {
        if let Some(e) = failure(&ended) {
            return Err(e);
        }
    }
    let usage = ended.usage.as_ref();
    let gpu = usage.map_or(0.0, |u| u.max_gpu_ram.combined);
    let rss = usage.map_or(0.0, |u| u.max_ram.combined.total_rss);
    let (memory, device) = if gpu > 0.0 {
        (
            MemoryKind::Gpu,
            opts.gpu_uuid
                .clone()
                .unwrap_or_else(|| "cuda (NVML)".into()),
        )
    } else {
        (MemoryKind::Cpu, "cpu".to_owned())
    };
    Ok(ProbeReport {
        memory,
        device,
        peak_allocated: None,
        peak_reserved: None,
        nvml_peak: (gpu > 0.0).then_some(Bytes(gpu as u64)),
        rss_peak: Some(Bytes(rss as u64)),
        steps: opts.steps,
        duration: ended.elapsed,
        ended_by_timeout: ended.timed_out,
        command: true,
    })
}
