//! `torchtools reserve` and `torchtools locks`.

use std::ffi::OsString;
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::Result;
use tt_device::{Bytes, Inventory};
use tt_lock::{GpuKey, GpuSpec, Holder, LockDir};
use tt_reserve::ReserveOptions;

use crate::child::{self, Exit};

/// Exit status when the GPUs stay locked past `--timeout` (sysexits' EX_TEMPFAIL).
pub(crate) const EXIT_LOCKED: u8 = tt_device::EX_TEMPFAIL as u8;
/// What `reserve` was asked for.
pub(crate) struct Request {
    pub(crate) gpus: Vec<GpuSpec>,
    pub(crate) count: Option<usize>,
    pub(crate) bytes: Option<Bytes>,
    pub(crate) margin: Bytes,
    pub(crate) fence: bool,
    pub(crate) share: bool,
    /// With `share`: cap the command's PyTorch allocator (`PYTORCH_CUDA_ALLOC_CONF`).
    pub(crate) cap: bool,
    pub(crate) timeout: Option<Duration>,
    pub(crate) command: Vec<OsString>,
}

pub(crate) fn reserve(req: Request) -> Result<ExitCode> {
    let command_text: Vec<String> = req
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut reservation = take(&req)?;
    let mut cmd = Command::new(&req.command[0]);
    cmd.args(&req.command[1..]);
    reservation.prepare(&mut cmd);
    if req.share && !req.cap {
        match std::env::var_os("PYTORCH_CUDA_ALLOC_CONF") {
            Some(own) => cmd.env("PYTORCH_CUDA_ALLOC_CONF", own),
            None => cmd.env_remove("PYTORCH_CUDA_ALLOC_CONF"),
        };
    }
    let running = child::spawn(&mut cmd, &command_text[0])?;
    if let Err(e) = reservation.record_command_pid(running.pid()) {
        tracing::warn!("cannot record the command's pid: {e}");
    }
    let ended = running.wait()?;
    reservation.set_exit_status(i32::from(ended.code));
    // The reservation (fences, then locks) lives exactly as long as the command.
    drop(reservation);
    Ok(ExitCode::from(ended.code))
}

/// Takes the reservation `req` asks for (waiting in the queue), saying what it took;
/// the errors exit as `reserve` documents (75 still locked, 2 a bad request).
pub(crate) fn take(req: &Request) -> Result<tt_reserve::Reservation> {
    if req.share && req.bytes.is_none() {
        return Err(Exit(
            2,
            "--share needs the job's budget: give --bytes (e.g. --share --bytes 20GiB); \
             sharers are admitted while their budgets fit in the GPU's memory"
                .into(),
        )
        .into());
    }
    if req.fence && !req.share && req.bytes.is_none() {
        return Err(Exit(
            2,
            "a fence leaves free only what --bytes says the command needs: give --bytes \
             (e.g. --bytes 6GiB), or --no-fence to take the lock alone"
                .into(),
        )
        .into());
    }
    let command_text: Vec<String> = req
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mut holder = Holder::current().running(command_text.clone());
    if let Some(bytes) = req.bytes {
        holder = holder.reserving(bytes);
    }
    let options = ReserveOptions {
        gpus: req.gpus.clone(),
        count: req.count,
        training_reserved_bytes: req.bytes.unwrap_or_default(),
        safety_margin_bytes: req.margin,
        blocking: true,
        timeout: req.timeout,
        fence: req.fence,
        holder: Some(holder),
        share: req.share,
    };
    let reservation =
        tt_reserve::reserve_with(options, |w| eprintln!("torchtools: {w}")).map_err(|e| {
            if e.is_busy() {
                Exit(EXIT_LOCKED, e.to_string()).into()
            } else if e.is_bad_request() {
                Exit(2, format!("{e} (see --gpu and --count)")).into()
            } else {
                anyhow::Error::from(e)
            }
        })?;
    if reservation.is_empty() {
        eprintln!("torchtools: no GPU on this machine: nothing reserved, running the command");
    } else if let (true, Some(bytes)) = (req.share, req.bytes) {
        for gpu in reservation.gpus() {
            eprintln!(
                "torchtools: sharing {} with a budget of {bytes} ({}; the command's PyTorch \
                 allocator {})",
                gpu.key,
                if req.fence {
                    "memory no sharer budgeted is fenced"
                } else {
                    "no fence"
                },
                if req.cap {
                    "is capped at it"
                } else {
                    "is not capped (--no-cap)"
                }
            );
        }
    } else {
        eprintln!(
            "torchtools: reserved {}",
            reservation
                .gpus()
                .iter()
                .map(|g| g.key.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for fence in reservation.fences() {
        eprintln!("torchtools: {}", fence.report());
    }
    Ok(reservation)
}

pub(crate) fn locks(json: bool) -> Result<ExitCode> {
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
    Ok(ExitCode::SUCCESS)
}

/// `torchtools queue`: the requests waiting, first served first.
pub(crate) fn queue(json: bool) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let inventory = Inventory::query();
    let waiters = dir.queue()?;
    let now = now_unix();
    if json {
        let mut list = Vec::with_capacity(waiters.len());
        for w in &waiters {
            let mut value = serde_json::to_value(w)?;
            if let Some(map) = value.as_object_mut() {
                map.insert("waiting_s".into(), now.saturating_sub(w.since_unix).into());
            }
            list.push(value);
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": dir.path(),
                "waiters": list,
                "ignored": dir.ignored()?,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", queue_text(&dir, &waiters, &inventory, now));
    crate::ignored::say(&dir.ignored()?);
    Ok(ExitCode::SUCCESS)
}

/// Whole seconds since the Unix epoch ([`tt_device::now_unix`]), as the queue's
/// records count them.
pub(crate) fn now_unix() -> u64 {
    tt_device::now_unix() as u64
}

/// The queue as a table, one line per request.
pub(crate) fn queue_text(
    dir: &LockDir,
    waiters: &[tt_lock::Waiter],
    inventory: &Inventory,
    now: u64,
) -> String {
    let mut out = format!(
        "GPU requests waiting in {} (served first come, first served): {}\n",
        dir.path().display(),
        waiters.len()
    );
    if waiters.is_empty() {
        return out;
    }
    let rows: Vec<[String; 7]> = waiters
        .iter()
        .map(|w| {
            [
                w.position.to_string(),
                w.user.clone(),
                w.pid.to_string(),
                age(now.saturating_sub(w.since_unix)),
                wants_text(&w.wants, |key| {
                    inventory
                        .gpus
                        .iter()
                        .find(|g| GpuKey::of_uuid(&g.uuid) == *key)
                        .map(|g| g.nvml_index)
                }),
                w.reserved.map_or("-".into(), |b| b.to_string()),
                w.command.join(" "),
            ]
        })
        .collect();
    let header = ["#", "user", "pid", "waiting", "wants", "bytes", "command"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 7]| {
        let mut text = String::from(" ");
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                text.push(' ');
                text.push_str(cell);
            } else {
                text.push_str(&format!(" {cell:<w$}", w = widths[i]));
            }
        }
        text.trim_end().to_owned() + "\n"
    };
    out.push_str(&line(header));
    for row in &rows {
        out.push_str(&line(row.each_ref().map(String::as_str)));
    }
    out
}

/// A wait as `45s`, `3m05s`, `2h07m`.
pub(crate) fn age(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{:02}s", secs / 60, secs % 60),
        _ => format!("{}h{:02}m", secs / 3600, secs / 60 % 60),
    }
}

/// What a request waits for, each GPU named as users name it: NVML's index when
/// `nvml_index` knows it, else its key.
pub(crate) fn wants_text(
    wants: &tt_lock::Wants,
    nvml_index: impl Fn(&GpuKey) -> Option<u32>,
) -> String {
    let label = |key: &GpuKey| match (key, nvml_index(key)) {
        (_, Some(i)) | (&GpuKey::Index(i), None) => format!("GPU {i}"),
        (GpuKey::Uuid(u), None) => u.clone(),
    };
    match wants {
        tt_lock::Wants::Gpus { gpus } => gpus.iter().map(label).collect::<Vec<_>>().join(" + "),
        tt_lock::Wants::Auto { count, among } => {
            format!("auto: {count} of {} GPU(s)", among.len())
        }
        tt_lock::Wants::Share { gpu, capacity, .. } => {
            format!("a share of {} ({capacity})", label(gpu))
        }
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
