//! `cargo bench -p tt-probe` (and `cargo xtask bench`): what probing costs over the
//! probe's own work, on CPU. Goals: a Rust probe costs at most this binary's start-up
//! (a libtorch-linked binary: ~0.2 s here) + 50 ms; `probe_command` adds ≤ 50 ms.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines.

use std::process::Command;
use std::time::{Duration, Instant};

use tt_probe::{probe, probe_command, BoxError, CommandProbe, ProbeContext, ProbeOptions, Step};

fn work(ctx: &ProbeContext) -> Result<Step, BoxError> {
    let device = ctx.device;
    Ok(Box::new(move || {
        let x = tch::Tensor::f_ones([256, 256], (tch::Kind::Float, device))?;
        let _ = x.f_matmul(&x)?;
        Ok(())
    }))
}

use tt_testkit::bench::median;

fn main() {
    tt_probe::entry(&[("work", work)]);
    if std::env::args().any(|a| a == "--startup-only") {
        // Load libtorch (as a probe child does), then stop: the start-up baseline.
        let _ = tch::Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu));
        return;
    }
    if std::env::args().any(|a| a == "--probe-child") {
        return; // entry() ran the probe and exited; never run the benchmark again
    }
    let opts = ProbeOptions {
        steps: 5,
        device: Some("cpu".into()),
        timeout: Duration::from_secs(60),
        child_args: vec!["--probe-child".into()],
        batch: None,
    };
    // The same binary started and doing nothing (its libtorch start-up).
    let exe = std::env::current_exe().expect("exe");
    let startup = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                let _ = Command::new(&exe).arg("--startup-only").status();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let mut total = Vec::new();
    let mut own = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let r = probe("work", &opts).expect("probe");
        total.push(t.elapsed().as_secs_f64() * 1e3);
        own.push(r.duration.as_secs_f64() * 1e3);
    }
    let (total, own) = (median(total), median(own));
    let overhead = total - own;
    // A command probe of `true` against running `true`.
    let plain = median(
        (0..10)
            .map(|_| {
                let t = Instant::now();
                let _ = Command::new("true").status();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let probed = median(
        (0..10)
            .map(|_| {
                let t = Instant::now();
                let _report =
                    probe_command(&"true".into(), &[], &CommandProbe::default()).expect("probe");
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    println!("tt-probe (CPU)");
    println!("  Rust probe: {total:.1} ms in all, {own:.1} ms of probe work, {overhead:.1} ms overhead; this binary starts in {startup:.1} ms");
    println!("  command probe of `true`: {probed:.1} ms vs {plain:.1} ms to run it");
    println!("row|Rust probe overhead over its work (ms)|{overhead:.1}|goal: start-up + 50 ms|{:.1}|ms|lower", startup + 50.0);
    println!(
        "row|command probe overhead, `true` (ms)|{:.1}|goal|50.0|ms|lower",
        probed - plain
    );
}
