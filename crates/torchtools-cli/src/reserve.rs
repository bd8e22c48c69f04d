//! `torchtools reserve` and `torchtools locks`.

use std::ffi::OsString;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tt_device::{Bytes, Inventory};
use tt_fence::{Fence, FenceOptions};
use tt_lock::{GpuKey, GpuLock, GpuSpec, Holder, LockDir, LockState, Wait};

use crate::child::{self, Exit};

/// Exit status when the GPUs stay locked past `--timeout` (sysexits' EX_TEMPFAIL).
pub(crate) const EXIT_LOCKED: u8 = 75;
/// What `reserve` was asked for.
pub(crate) struct Request {
    pub(crate) gpus: Vec<GpuSpec>,
    pub(crate) count: Option<usize>,
    pub(crate) bytes: Option<Bytes>,
    pub(crate) margin: Bytes,
    pub(crate) fence: bool,
    pub(crate) timeout: Option<Duration>,
    pub(crate) command: Vec<OsString>,
}

pub(crate) fn reserve(req: Request) -> Result<ExitCode> {
    if req.fence && req.bytes.is_none() {
        return Err(Exit(
            2,
            "a fence leaves free only what --bytes says the command needs: give --bytes \
             (e.g. --bytes 6GiB), or --no-fence to take the lock alone"
                .into(),
        )
        .into());
    }
    let dir = LockDir::from_env()?;
    let inventory = Inventory::query();
    let command_text: Vec<String> = req
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut holder = Holder::current().running(command_text.clone());
    if let Some(bytes) = req.bytes {
        holder = holder.reserving(bytes);
    }
    let locks = take_locks(&dir, &inventory, &req, &holder)?;
    let keys: Vec<GpuKey> = locks.iter().map(|l| l.key().clone()).collect();
    eprintln!(
        "torchtools: reserved {}",
        keys.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );

    // The fence, in this process: it lives as long as `torchtools` does.
    let mut fences = Vec::new();
    if req.fence {
        let options = FenceOptions {
            safety_margin: req.margin,
            ..FenceOptions::keep_free(req.bytes.unwrap_or_default())
        };
        for key in &keys {
            let GpuKey::Uuid(uuid) = key else {
                bail!(
                    "cannot fence {key}: without NVML the GPU's identity is unknown; \
                     use --no-fence to reserve with the lock alone"
                );
            };
            let fence = Fence::raise_on_uuid(uuid, &options)?;
            eprintln!("torchtools: {}", fence.report());
            fences.push(fence);
        }
    }

    let mut cmd = Command::new(&req.command[0]);
    cmd.args(&req.command[1..]).env(
        "CUDA_VISIBLE_DEVICES",
        keys.iter()
            .map(GpuKey::cuda_visible_entry)
            .collect::<Vec<_>>()
            .join(","),
    );
    tt_lock::share_with(&mut cmd, &locks);
    let running = child::spawn(&mut cmd, &command_text[0])?;
    let child_pid = running.pid();
    let mut locks = locks;
    for lock in &mut locks {
        let mut record = lock.holder().clone();
        record.command_pid = Some(child_pid);
        if let Err(e) = lock.set_holder(record) {
            tracing::warn!("cannot record the command's pid: {e}");
        }
    }
    let ended = running.wait()?;
    drop(fences);
    drop(locks);
    Ok(ExitCode::from(ended.code))
}

fn take_locks(
    dir: &LockDir,
    inventory: &Inventory,
    req: &Request,
    holder: &Holder,
) -> Result<Vec<GpuLock>> {
    let wait = match req.timeout {
        Some(t) => Wait::Timeout(t),
        None => Wait::Block,
    };
    let auto = req.gpus.contains(&GpuSpec::Auto);
    let attempt = |wait: Wait| -> tt_lock::Result<Vec<GpuLock>> {
        if auto {
            dir.lock_auto(inventory, req.count.unwrap_or(1), wait, holder.clone())
        } else {
            let keys = req
                .gpus
                .iter()
                .map(|spec| spec.resolve(inventory))
                .collect::<tt_lock::Result<Vec<_>>>()?;
            dir.lock_many(&keys, wait, holder.clone())
        }
    };
    if auto && req.gpus.len() > 1 {
        return Err(Exit(2, "--gpu auto cannot be combined with other GPUs".into()).into());
    }
    if let (false, Some(count)) = (auto, req.count) {
        if count != req.gpus.len() {
            return Err(Exit(
                2,
                format!(
                    "--count {count} but {} GPU(s) named: use --count with --gpu auto",
                    req.gpus.len()
                ),
            )
            .into());
        }
    }
    let start = Instant::now();
    let first = attempt(Wait::Try);
    let locked = match first {
        Err(tt_lock::Error::WouldBlock { gpu, holder }) if wait != Wait::Try => {
            let by = holder.map_or("a process that left no record".into(), |h| h.to_string());
            let until = match req.timeout {
                Some(t) => format!(" (at most {t:?})"),
                None => String::new(),
            };
            eprintln!("torchtools: {gpu} is locked by {by}; waiting{until}");
            let remaining = match wait {
                Wait::Timeout(t) => Wait::Timeout(t.saturating_sub(start.elapsed())),
                other => other,
            };
            attempt(remaining)
        }
        other => other,
    };
    locked.map_err(|e| match e {
        e @ (tt_lock::Error::Timeout { .. } | tt_lock::Error::WouldBlock { .. }) => {
            Exit(EXIT_LOCKED, e.to_string()).into()
        }
        e @ (tt_lock::Error::InvalidGpu { .. } | tt_lock::Error::UnknownGpu { .. }) => {
            Exit(2, e.to_string()).into()
        }
        e => anyhow::Error::from(e),
    })
}

pub(crate) fn locks(json: bool) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let inventory = Inventory::query();
    let states = dir.status(&inventory)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": dir.path(),
                "nvml": inventory.nvml,
                "locks": states,
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
        println!("  {}", line(state));
    }
    Ok(ExitCode::SUCCESS)
}

fn line(state: &LockState) -> String {
    let name = match (&state.nvml_index, &state.name, &state.gpu) {
        (Some(i), Some(n), GpuKey::Uuid(u)) => format!("{i}  {n}  {u}"),
        (_, _, GpuKey::Uuid(u)) => format!("?  {u}"),
        (_, _, GpuKey::Index(i)) => format!("{i}  (keyed by index: no NVML)"),
    };
    match (&state.held, &state.holder) {
        (false, _) => format!("{name}: free"),
        (true, Some(h)) => format!("{name}: held by {h}"),
        (true, None) => format!("{name}: held (no record yet)"),
    }
}

/// `--margin`'s default: tt-fence's `DEFAULT_SAFETY_MARGIN` (a test checks they agree).
pub(crate) const DEFAULT_MARGIN: &str = "50MiB";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_margin_is_tt_fences() {
        assert_eq!(
            crate::args::size(DEFAULT_MARGIN),
            Ok(tt_fence::DEFAULT_SAFETY_MARGIN)
        );
    }
}
