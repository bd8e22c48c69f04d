//! `torchtools usage`: GPU-hours and reserved GiB-hours from the lock directory's usage
//! log (tt-lock's `LockDir::usage`).

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde::Serialize;
use tt_lock::LockDir;

/// Show who used the GPUs, and how much.
///
/// Who used the GPUs, and how much: GPU-hours and reserved GiB-hours per user (or
/// per GPU) from the lock directory's usage log, which every reservation writes
/// (`reserve`, `run`, `launch --gpu`, the API). A holder that died holding its GPU
/// is counted until ten minutes after its last sign of life in its log (or until
/// now), marked lost.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Only reservations that ended in this last while (or still run): 7d, 24h, 30m.
    #[arg(long, value_parser = crate::args::duration)]
    pub(crate) since: Option<std::time::Duration>,
    /// Group by user (default) or by GPU.
    #[arg(long, value_enum, default_value_t = crate::commands::usage::By::User)]
    pub(crate) by: crate::commands::usage::By,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let (since, by) = (args.since, args.by);
    let dir = LockDir::from_env()?;
    let now = tt_device::now_unix();
    let from = since.map_or(f64::MIN, |d| now - d.as_secs_f64());
    let log = dir.usage_totals(&[from]).context("reading the usage log")?;
    for why in &log.skipped {
        eprintln!("torchtools usage: warning: skipped a damaged record: {why}");
    }
    if !log.skipped.is_empty() {
        eprintln!(
            "torchtools usage: {} damaged line(s) skipped; every other record is counted",
            log.skipped.len()
        );
    }
    let rows = log.windows.first().map_or_else(Vec::new, |t| rows(t, by));
    if args.json {
        #[derive(Serialize)]
        struct Out<'a> {
            log: String,
            since_unix: Option<f64>,
            by: &'a str,
            rows: &'a [Row],
            skipped: &'a [String],
            ignored: &'a [tt_lock::Ignored],
        }
        let out = Out {
            log: dir
                .path()
                .join(format!("{}*.jsonl", tt_lock::USAGE_PREFIX))
                .display()
                .to_string(),
            since_unix: since.map(|_| from),
            by: match by {
                By::User => "user",
                By::Gpu => "gpu",
            },
            rows: &rows,
            skipped: &log.skipped,
            ignored: &log.ignored,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", text(&rows, by));
    crate::ignored::say(&log.ignored);
    crate::commands::policy::say_notes(&dir);
    Ok(ExitCode::SUCCESS)
}

/// How `usage` groups its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum By {
    User,
    Gpu,
}

/// One row: a user's (or a GPU's) use.
#[derive(Debug, Default, Clone, Serialize, PartialEq)]
pub(crate) struct Row {
    /// The user or the GPU.
    pub(crate) name: String,
    /// Reservations counted.
    pub(crate) reservations: usize,
    /// Of which still running.
    pub(crate) running: usize,
    /// Of which their holder died holding the GPU.
    pub(crate) lost: usize,
    /// Hours of GPU held, one GPU for one hour being one GPU-hour.
    pub(crate) gpu_hours: f64,
    /// Reserved bytes held, in GiB-hours.
    pub(crate) reserved_gib_hours: f64,
}

/// The rows of `totals`, grouped `by`, the most GPU-hours first.
pub(crate) fn rows(totals: &tt_lock::UsageTotals, by: By) -> Vec<Row> {
    let group = match by {
        By::User => &totals.by_user,
        By::Gpu => &totals.by_gpu,
    };
    let mut rows: Vec<Row> = group
        .iter()
        .map(|(name, t)| Row {
            name: name.clone(),
            reservations: t.reservations,
            running: t.running,
            lost: t.lost,
            gpu_hours: t.gpu_seconds / 3600.0,
            reserved_gib_hours: t.reserved_byte_seconds / 3600.0 / (1u64 << 30) as f64,
        })
        .collect();
    rows.sort_by(|a, b| {
        b.gpu_hours
            .total_cmp(&a.gpu_hours)
            .then(a.name.cmp(&b.name))
    });
    rows
}

fn text(rows: &[Row], by: By) -> String {
    let head = match by {
        By::User => "user",
        By::Gpu => "GPU",
    };
    let width = rows
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(0)
        .max(head.len());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{head:<width$}  {:>9}  {:>14}  {:>12}",
        "GPU-hours", "reserved GiB·h", "reservations"
    );
    for r in rows {
        let mut notes = Vec::new();
        if r.running > 0 {
            notes.push(format!("{} running", r.running));
        }
        if r.lost > 0 {
            notes.push(format!("{} lost", r.lost));
        }
        let notes = if notes.is_empty() {
            String::new()
        } else {
            format!("  ({})", notes.join(", "))
        };
        let _ = writeln!(
            out,
            "{:<width$}  {:>9.3}  {:>14.3}  {:>12}{notes}",
            r.name, r.gpu_hours, r.reserved_gib_hours, r.reservations
        );
    }
    if rows.is_empty() {
        out.push_str("no reservation recorded\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tt_lock::Usage;

    fn record(user: &str, gpu: &str, start: f64, end: Option<f64>, gib: u64) -> Usage {
        Usage {
            id: format!("{user}-{start}"),
            user: user.into(),
            host: "h".into(),
            pid: 1,
            gpu: gpu.into(),
            bytes: Some(gib << 30),
            command: Vec::new(),
            share_of: None,
            since_unix: start,
            ended_unix: end,
            status: None,
            lost: false,
            alive: None,
        }
    }

    #[test]
    fn hours_are_summed_per_user_or_gpu_and_cut_at_since() {
        let records = [
            record("ada", "GPU-a", 0.0, Some(7200.0), 4),
            record("ada", "GPU-b", 3600.0, None, 0),
            record("bob", "GPU-a", 7200.0, Some(9000.0), 2),
        ];
        let now = 10_800.0;
        let totals = |from: f64| {
            let mut totals = tt_lock::UsageTotals::from(from);
            for r in &records {
                totals.add(r, now);
            }
            totals
        };
        let by_user = rows(&totals(f64::MIN), By::User);
        assert_eq!(by_user[0].name, "ada");
        assert!((by_user[0].gpu_hours - 4.0).abs() < 1e-9, "{by_user:?}");
        assert!((by_user[0].reserved_gib_hours - 8.0).abs() < 1e-9);
        assert_eq!((by_user[0].reservations, by_user[0].running), (2, 1));
        assert!((by_user[1].gpu_hours - 0.5).abs() < 1e-9);
        let by_gpu = rows(&totals(f64::MIN), By::Gpu);
        assert_eq!(by_gpu[0].name, "GPU-a");
        assert!((by_gpu[0].gpu_hours - 2.5).abs() < 1e-9);
        // The last hour only: ada's first ended as it began, not counted; her second
        // counts from its start, bob's whole.
        let last_hour = rows(&totals(now - 3600.0), By::User);
        assert_eq!(last_hour.len(), 2, "{last_hour:?}");
        assert_eq!(last_hour[0].reservations, 1, "{last_hour:?}");
        assert!((last_hour[0].gpu_hours - 1.0).abs() < 1e-9);
        assert!((last_hour[1].gpu_hours - 0.5).abs() < 1e-9);
        assert!(text(&by_user, By::User).contains("(1 running)"));
    }
}
