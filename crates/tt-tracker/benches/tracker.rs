//! `cargo bench -p tt-tracker` (and `cargo xtask bench`): tt-tracker against
//! gpu-tracker 5.0.1 (pip, in the setup venv: `cargo xtask bench` installs it), side by
//! side on the same commands: start-up, CPU cost of tracking, peaks of short spikes.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tt_tracker::{Target, Tracker, TrackerConfig};

const SPIKE_PY: &str = "import sys, time\n\
ms = int(sys.argv[1])\n\
x = bytearray(b'\\x01') * (512 << 20)\n\
time.sleep(ms / 1000)\n\
del x\n\
time.sleep(1.5)\n";

fn cpu_seconds_self() -> f64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// A shell with `n` sleeping children: a process tree to track.
fn tree(n: usize) -> Child {
    Command::new("sh")
        .arg("-c")
        .arg(format!("for i in $(seq {n}); do sleep 60 & done; wait"))
        .spawn()
        .expect("sh")
}

/// Our CPU cost, in percent of one core, of tracking `target` for `secs` at `interval`.
fn our_cost(target: Target, interval: Duration, secs: f64) -> f64 {
    let tracker = Tracker::start(TrackerConfig {
        interval,
        target,
        ..TrackerConfig::default()
    })
    .expect("start");
    let c0 = cpu_seconds_self();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let cpu = cpu_seconds_self() - c0;
    let wall = t0.elapsed().as_secs_f64();
    let _ = tracker.stop();
    cpu / wall * 100.0
}

fn python() -> Option<PathBuf> {
    let py = PathBuf::from(std::env::var_os("TORCHTOOLS_PYTHON")?);
    let ok = Command::new(&py)
        .args(["-c", "import gpu_tracker"])
        .stderr(Stdio::null())
        .status()
        .ok()?
        .success();
    ok.then_some(py)
}

/// gpu-tracker's CPU cost (its process + its tracking process), percent of a core.
fn their_cost(py: &Path, pid: u32, sleep_time: f64, secs: f64) -> Option<f64> {
    let script = format!(
        "import os, time, logging\nlogging.disable(logging.WARNING)\n\
         from gpu_tracker import Tracker\n\
         t = Tracker(process_id={pid}, sleep_time={sleep_time})\n\
         c0 = os.times(); w0 = time.time()\n\
         t.start(); time.sleep({secs}); t.stop()\n\
         c1 = os.times(); w1 = time.time()\n\
         cpu = sum(c1[:4]) - sum(c0[:4])\n\
         print(cpu / (w1 - w0) * 100)\n"
    );
    let out = Command::new(py).args(["-c", &script]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

use tt_testkit::bench::median;

fn wall_ms(mut make: impl FnMut() -> Command, runs: usize) -> Option<f64> {
    let mut times = Vec::new();
    for _ in 0..runs {
        let mut c = make();
        c.stdout(Stdio::null()).stderr(Stdio::null());
        let t = Instant::now();
        c.status().ok()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Some(median(times))
}

/// The release CLI beside this bench (`target/release/torchtools`), if built.
fn cli() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("torchtools");
    bin.exists().then_some(bin)
}

fn json_number(text: &str, path: &[&str]) -> Option<f64> {
    let start = text.find('{')?;
    let mut v: serde_json::Value = serde_json::from_str(&text[start..]).ok()?;
    for p in path {
        v = v.get(*p)?.clone();
    }
    v.as_f64()
}

fn main() {
    let py = python();
    if py.is_none() {
        println!("  (no gpu-tracker baseline: run `cargo xtask bench`, which installs gpu-tracker 5.0.1 into the setup venv)");
    }

    // Start-up: library start (first sample taken) + stop, and the CLI around `true`.
    let lib_start = median(
        (0..20)
            .map(|_| {
                let t = Instant::now();
                let tracker = Tracker::start(TrackerConfig::default()).expect("start");
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let _ = tracker.stop();
                ms
            })
            .collect(),
    );
    println!("tt-tracker");
    println!("  Tracker::start (first sample taken): {lib_start:.2} ms");
    if let Some(py) = &py {
        let script = "import time, logging\nlogging.disable(logging.WARNING)\n\
                      from gpu_tracker import Tracker\n\
                      t0 = time.perf_counter(); t = Tracker(sleep_time=0.1); t.start()\n\
                      t1 = time.perf_counter(); t.stop(); print((t1 - t0) * 1e3)\n";
        let theirs: Vec<f64> = (0..3)
            .filter_map(|_| {
                let out = Command::new(py).args(["-c", script]).output().ok()?;
                String::from_utf8_lossy(&out.stdout).trim().parse().ok()
            })
            .collect();
        if !theirs.is_empty() {
            let theirs = median(theirs);
            println!("  gpu_tracker Tracker().start(): {theirs:.1} ms");
            println!("row|tracker start (ms)|{lib_start:.2}|gpu-tracker 5.0.1 Tracker.start|{theirs:.1}|ms|lower");
        }
    }
    if let (Some(cli), Some(py)) = (cli(), &py) {
        let ours = wall_ms(
            || {
                let mut c = Command::new(&cli);
                c.args(["track", "--", "true"]);
                c
            },
            10,
        );
        let gt = py.with_file_name("gpu-tracker");
        let theirs = wall_ms(
            || {
                let mut c = Command::new(&gt);
                c.args(["-e", "true"]);
                c
            },
            3,
        );
        if let (Some(ours), Some(theirs)) = (ours, theirs) {
            println!(
                "  `torchtools track -- true`: {ours:.1} ms; `gpu-tracker -e true`: {theirs:.1} ms"
            );
            println!("row|CLI: track `true`, wall (ms)|{ours:.1}|gpu-tracker -e true|{theirs:.1}|ms|lower");
        }
    }

    // CPU cost with a 50-process tree, and for one process at 10 ms.
    let mut t50 = tree(50);
    std::thread::sleep(Duration::from_millis(500));
    let ours_100 = our_cost(Target::Pid(t50.id()), Duration::from_millis(100), 5.0);
    let ours_10_tree = our_cost(Target::Pid(t50.id()), Duration::from_millis(10), 5.0);
    let theirs_100 = py
        .as_ref()
        .and_then(|py| their_cost(py, t50.id(), 0.1, 5.0));
    let _ = t50.kill();
    let _ = Command::new("pkill")
        .args(["-P", &t50.id().to_string()])
        .status();
    let _ = t50.wait();
    let mut one = Command::new("sleep").arg("60").spawn().expect("sleep");
    let ours_10_one = our_cost(Target::Pid(one.id()), Duration::from_millis(10), 5.0);
    let _ = one.kill();
    let _ = one.wait();
    println!("  CPU, 50-process tree: {ours_100:.2}% of a core at 100 ms, {ours_10_tree:.2}% at 10 ms; one process at 10 ms: {ours_10_one:.2}%");
    match theirs_100 {
        Some(t) => {
            println!("  gpu-tracker, 50-process tree at 100 ms (its minimum): {t:.1}% of a core");
            println!("row|CPU of tracking 50 processes at 100 ms (% core)|{ours_100:.2}|gpu-tracker 5.0.1 at 100 ms|{t:.1}|%|lower");
        }
        None => println!(
            "row|CPU of tracking 50 processes at 100 ms (% core)|{ours_100:.2}|goal|1.0|%|lower"
        ),
    }
    println!("row|CPU of tracking 1 process at 10 ms (% core)|{ours_10_one:.2}|goal|2.0|%|lower");
    proc_reads();

    // Peaks of 512 MiB spikes, each tool at its default interval.
    let (Some(cli), Some(py)) = (cli(), &py) else {
        println!("  (spike peaks need the release CLI and gpu-tracker: run `cargo xtask bench`)");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("spike.py");
    std::fs::write(&script, SPIKE_PY).expect("write");
    let gt = py.with_file_name("gpu-tracker");
    for ms in [20, 100, 300] {
        let out = Command::new(&cli)
            .args(["track", "--ram-unit", "megabytes", "--format", "json", "--"])
            .arg(py)
            .arg(&script)
            .arg(ms.to_string())
            .output()
            .expect("torchtools track");
        let ours = json_number(
            &String::from_utf8_lossy(&out.stderr),
            &["max_ram", "main", "total_rss"],
        );
        let cmdline = format!("{} {} {ms}", py.display(), script.display());
        let out = Command::new(&gt)
            .args([
                "-e",
                &cmdline,
                "--ru=megabytes",
                "--format=json",
                "--disable-logs",
            ])
            .output()
            .expect("gpu-tracker");
        let theirs = json_number(
            &String::from_utf8_lossy(&out.stdout),
            &["max_ram", "main", "total_rss"],
        );
        if let (Some(ours), Some(theirs)) = (ours, theirs) {
            println!(
                "  512 MiB (536.9 MB) for {ms} ms: ours {ours:.1} MB, gpu-tracker {theirs:.1} MB"
            );
            println!("row|peak RSS of a 512 MiB {ms} ms spike (MB)|{ours:.1}|gpu-tracker 5.0.1 (1 s default)|{theirs:.1}|MB|higher");
        }
    }
}

/// One tick's reads of 20 live processes (CPU and threads from `stat`, RSS from
/// `statm`, the high-water mark from `status`): tt-tracker's files kept open and
/// `pread` against the `procfs` crate (the design card's library: `Process::new`,
/// then `stat`, `statm` and `status`, each an `open` and a parse), alternating, in the
/// same run. Microseconds per tick, medians of 200 ticks.
fn proc_reads() {
    use tt_tracker::process::ProcessReader;
    let mut children = tree(20);
    std::thread::sleep(Duration::from_millis(300));
    let mut pids = vec![children.id()];
    if let Ok(text) = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", children.id()))
    {
        pids.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    let mut readers: Vec<ProcessReader> = pids
        .iter()
        .filter_map(|&p| ProcessReader::open(p))
        .collect();
    let page = procfs::page_size();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let mut sink = 0u64;
    for _ in 0..200 {
        let t = Instant::now();
        for r in &mut readers {
            if let Some(s) = r.read(true) {
                sink = sink.wrapping_add(s.cpu_ticks + s.rss + s.hwm + s.threads);
            }
        }
        ours.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        for &pid in &pids {
            let Ok(p) = procfs::process::Process::new(pid as i32) else {
                continue;
            };
            if let (Ok(stat), Ok(statm), Ok(status)) = (p.stat(), p.statm(), p.status()) {
                sink = sink.wrapping_add(
                    stat.utime
                        + stat.stime
                        + stat.num_threads as u64
                        + statm.resident * page
                        + status.vmhwm.unwrap_or(0),
                );
            }
        }
        theirs.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let _ = children.kill();
    let _ = children.wait();
    let (ours, theirs) = (median(ours), median(theirs));
    println!("  /proc reads of {} processes per tick: {ours:.0} µs kept open, {theirs:.0} µs with the procfs crate ({sink})", pids.len());
    println!(
        "row|/proc reads of {} processes per tick (µs)|{ours:.0}|procfs 0.17 crate|{theirs:.0}|µs|lower",
        pids.len()
    );
}
