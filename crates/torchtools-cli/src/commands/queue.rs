//! `torchtools queue`: the requests waiting for GPUs, first served first; and how a
//! waiting request is shown (`top` shows it the same way).

use std::process::ExitCode;

use anyhow::Result;
use tt_lock::{GpuKey, LockDir};

use crate::snapshot::{Gpus, Snapshot};

/// Show the requests waiting for GPUs, in order.
///
/// Show the requests waiting for GPUs, in the order they will be served (first
/// come, first served, or by the machine's fair-share policy with each request's
/// priority and why): user, pid, how long, GPUs asked, bytes, command.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let snapshot = Snapshot::take(&LockDir::from_env()?, &Gpus::open())?;
    if args.json {
        let mut list = Vec::with_capacity(snapshot.queue.len());
        for w in &snapshot.queue {
            let mut value = serde_json::to_value(w)?;
            if let Some(map) = value.as_object_mut() {
                map.insert(
                    "waiting_s".into(),
                    snapshot.time_unix.saturating_sub(w.who.since_unix).into(),
                );
            }
            list.push(value);
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "lock_dir": snapshot.lock_dir,
                "policy": snapshot.policy,
                "waiters": list,
                "ignored": snapshot.ignored,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", queue_text(&snapshot));
    crate::ignored::say(&snapshot.ignored);
    for line in snapshot.over_limits() {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The queue as a table, one line per request; under a fair-share policy each with its
/// priority and why, and a request a limit holds back marked so.
pub(crate) fn queue_text(snapshot: &Snapshot) -> String {
    let (waiters, now, policy) = (
        &snapshot.queue,
        snapshot.time_unix,
        &snapshot.policy_in_force,
    );
    let order = match (&policy.status, policy.policy.orders_the_queue()) {
        (tt_lock::PolicyStatus::InForce, true) => format!(
            "served by the policy {}: `torchtools policy`",
            policy.path.display()
        ),
        (tt_lock::PolicyStatus::Ignored(_), _) => {
            format!("served first come, first served; {}", policy.summary())
        }
        _ => "served first come, first served".to_owned(),
    };
    let mut out = format!(
        "GPU requests waiting in {} ({}): {}\n",
        snapshot.lock_dir.display(),
        tt_device::printable(&order),
        waiters.len()
    );
    if waiters.is_empty() {
        return out;
    }
    let fair = waiters
        .iter()
        .any(|w| w.priority.is_some() || w.held.is_some());
    let rows: Vec<Vec<String>> = waiters
        .iter()
        .map(|w| {
            let mut row = vec![
                w.position.to_string(),
                tt_device::printable(&w.who.user).into_owned(),
                w.who.pid.to_string(),
                age(now.saturating_sub(w.who.since_unix)),
                wants_text(&w.wants, |key| snapshot.nvml_index(key)),
                w.who.reserved.map_or("-".into(), |b| b.to_string()),
            ];
            if fair {
                row.push(w.priority.map_or("-".into(), |p| format!("{p:+.2}")));
                let why = [w.held.as_deref(), w.why.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join("; ");
                row.push(tt_device::printable(&why).into_owned());
            }
            row.push(crate::args::shown(&w.who.command));
            row
        })
        .collect();
    let mut header = vec!["#", "user", "pid", "waiting", "wants", "bytes"];
    if fair {
        header.extend(["priority", "why"]);
    }
    header.push("command");
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
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
    out.push_str(&line(&header));
    for row in &rows {
        out.push_str(&line(&row.iter().map(String::as_str).collect::<Vec<_>>()));
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
