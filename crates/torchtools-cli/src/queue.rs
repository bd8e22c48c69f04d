//! `torchtools queue`: the requests waiting for GPUs, first served first; and how a
//! waiting request is shown (`top` shows it the same way).

use std::process::ExitCode;

use anyhow::Result;
use tt_device::Inventory;
use tt_lock::{GpuKey, LockDir};

/// `queue`'s options.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(args: Args) -> Result<ExitCode> {
    queue(args.json)
}

/// `torchtools queue`: the requests waiting, first served first.
fn queue(json: bool) -> Result<ExitCode> {
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
                tt_device::printable(&w.user).into_owned(),
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
                crate::args::shown(&w.command),
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
