//! `cargo xtask bench`: measured numbers, one table, ratios against named baselines.
//!
//! - `torchtools devices --json` (release build, no libtorch) against the Python
//!   torchtools way of choosing a device (`import torch; torch.cuda.is_available()`),
//!   in the venv of `cargo xtask setup`.
//! - The libtorch demo's process (report + selection, `TORCHTOOLS_DEMO_STEPS=1`)
//!   against the same Python baseline: the cost of choosing a device from Rust with
//!   libtorch loaded.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::setup::Libtorch;
use crate::steps::{self, cargo};

/// Median wall time of `runs` runs of `cmd` (after one warm-up run).
fn median_time(mut make: impl FnMut() -> Command, runs: usize) -> Result<Duration> {
    let mut times = Vec::with_capacity(runs);
    for i in 0..=runs {
        let mut cmd = make();
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        let start = Instant::now();
        let status = cmd
            .status()
            .with_context(|| format!("cannot start {cmd:?}"))?;
        let t = start.elapsed();
        if !status.success() {
            bail!("{cmd:?} failed ({status})");
        }
        if i > 0 {
            times.push(t);
        }
    }
    times.sort();
    Ok(times[times.len() / 2])
}

pub(crate) fn run() -> Result<()> {
    let libtorch = crate::setup::setup()?;
    let python = match &libtorch {
        Libtorch::Cached { venv } => venv.join("bin/python"),
        Libtorch::User => {
            PathBuf::from(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        }
    };
    steps::run(
        "build the CLI (release)",
        cargo(&["build", "--release", "-p", "torchtools-cli"]),
    )?;
    steps::run(
        "build the demo (release)",
        cargo(&[
            "build",
            "--release",
            "-p",
            "torchtools",
            "--example",
            "demo",
        ]),
    )?;
    let root = crate::root();
    let cli = root.join("target/release/torchtools");
    let demo = root.join("target/release/examples/demo");

    let baseline = median_time(
        || {
            let mut c = Command::new(&python);
            c.args([
                "-c",
                "import torch; torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
            ]);
            c
        },
        5,
    )?;
    let ours_cli = median_time(
        || {
            let mut c = Command::new(&cli);
            c.args(["devices", "--json"]);
            c
        },
        30,
    )?;
    let ours_demo = median_time(
        || {
            let mut c = Command::new(&demo);
            c.env("TORCHTOOLS_DEMO_STEPS", "1");
            c
        },
        5,
    )?;

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("\nbenchmark (median wall time; baseline: Python `import torch; torch.cuda.is_available()` in the setup venv)");
    println!(
        "{:<52} {:>10} {:>12} {:>8}",
        "what", "ours (ms)", "baseline (ms)", "ratio"
    );
    for (what, ours) in [
        ("torchtools devices --json (CLI, no libtorch)", ours_cli),
        (
            "demo process: report + select + 1 step (libtorch)",
            ours_demo,
        ),
    ] {
        println!(
            "{what:<52} {:>10.1} {:>12.1} {:>7.1}x",
            ms(ours),
            ms(baseline),
            ms(baseline) / ms(ours)
        );
    }
    println!("(ratio = baseline / ours: how many times faster)");
    Ok(())
}
