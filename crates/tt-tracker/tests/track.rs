//! The tracker over real process trees: exact peaks of short spikes at a 1 s interval,
//! attribution to main and descendants, 1000 short-lived children, timelines.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use tt_tracker::{RamUnit, TimeUnit, Tracker, TrackerConfig};

/// Tests that track this process (whose peak-RSS mark each tracker resets) take turns.
static THIS_PROCESS: Mutex<()> = Mutex::new(());

const ROLE: &str = "TT_TRACKER_TEST_ROLE";

fn vm_hwm() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line[6..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// Touches every page of `mib` MiB for 50 ms, then frees it.
fn spike(mib: usize) {
    let mut v = vec![0u8; mib << 20];
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&v);
    std::thread::sleep(Duration::from_millis(50));
    drop(v);
}

/// Holds `mib` MiB (every page touched) until `tracker` has taken two more samples
/// (the first may have begun before the memory was there), then frees it: a peak the
/// tracker is sure to see, on a busy machine too.
fn hold_until_sampled(tracker: &Tracker, mib: usize) {
    let mut v = vec![0u8; mib << 20];
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&v);
    let seen = tracker.samples();
    // At least 50 ms, as the blocks' durations below assume.
    std::thread::sleep(Duration::from_millis(50));
    wait_for_samples(tracker, seen + 2);
    drop(v);
}

/// Waits until `tracker` has recorded `n` samples (a generous bound only against a
/// tracker that stopped).
fn wait_for_samples(tracker: &Tracker, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while tracker.samples() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "the tracker stopped sampling"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A tracker of another process (`pid`), sampling every `interval`.
fn track_pid(pid: u32, interval: Duration) -> Tracker {
    Tracker::start(TrackerConfig {
        target: tt_tracker::Target::Pid(pid),
        ..config(interval)
    })
    .unwrap()
}

/// The reference Python running `script`, with its stdin and stdout piped (the tests'
/// scripts say "ready" or the like, then wait for stdin to close).
fn python_child(script: &str) -> std::process::Child {
    Command::new(tt_testkit::python_path())
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The child side: on a line from stdin, spike, report its own high-water mark, wait
/// for stdin to close.
#[test]
#[ignore = "a child process's entry point, run by the descendant-spike test"]
fn child() {
    if std::env::var(ROLE).as_deref() != Ok("spike") {
        return;
    }
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    spike(std::env::var("MIB").unwrap().parse().unwrap());
    println!("\n@@hwm={}@@", vm_hwm());
    std::io::stdout().flush().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
}

/// Past this, a test waiting on its children fails with where everything waits.
const HANG: Duration = Duration::from_secs(600);

fn config(interval: Duration) -> TrackerConfig {
    TrackerConfig {
        interval,
        ram_unit: RamUnit::Bytes,
        time_unit: TimeUnit::Seconds,
        ..TrackerConfig::default()
    }
}

fn within(reported: f64, truth: u64, tolerance: f64) -> bool {
    (reported - truth as f64).abs() <= truth as f64 * tolerance
}

/// The tracker of a process sees its children's exact peaks (their own high-water
/// marks, as they exit). Run in a test process of its own: the tests beside it in this
/// binary start children of this process too, and the tracker rightly counts them as
/// descendants (a Python of 58 MB once: "descendants 329580544 vs the child's own VmHWM
/// 271695872", 1 fresh-clone run in 7).
#[test]
fn a_50ms_spike_in_a_descendant_is_exact_at_a_1s_interval() {
    if std::env::var(ROLE).as_deref() != Ok("alone") {
        let out = tt_testkit::rerun("a_50ms_spike_in_a_descendant_is_exact_at_a_1s_interval")
            .env(ROLE, "alone")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        tt_testkit::assert_ran_one(&out);
        return;
    }
    tt_testkit::hang::within(HANG, "the descendant spike test", || {
        let started = std::time::Instant::now();
        let tracker = Tracker::start(config(Duration::from_secs(1))).unwrap();
        let mut child = tt_testkit::rerun("child")
            .env(ROLE, "spike")
            .env("MIB", "256")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let truth: u64 = loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0);
            if let Some(v) = line.trim().strip_prefix("@@hwm=") {
                break v.trim_end_matches("@@").parse().unwrap();
            }
        };
        // The spike is long over; the child lives until the tracker has taken a whole
        // sample after its report (two more: the first may have begun before it), then
        // exits. Waiting on the tracker's own count holds on a busy machine.
        wait_for_samples(&tracker, tracker.samples() + 2);
        drop(stdin);
        child.wait().unwrap();
        let usage = tracker.stop().unwrap();
        let r = &usage.max_ram;
        assert!(
            within(r.descendants.total_rss, truth, 0.02),
            "descendants {} vs the child's own VmHWM {truth}; {:?}",
            r.descendants.total_rss,
            usage.torchtools.peak_methods
        );
        assert!(truth > 256 << 20);
        assert!(
            r.main.total_rss < (256 << 20) as f64,
            "the spike is not main's: {r:?}"
        );
        assert!(r.combined.total_rss >= r.descendants.total_rss);
        assert!(r.combined.total_rss <= r.main.total_rss + r.descendants.total_rss + 1.0);
        // Never faster than the interval (a bound on the rate, which load cannot break).
        let seconds = started.elapsed().as_secs_f64();
        assert!(
            usage.torchtools.samples as f64 <= seconds + 1.0,
            "a 1 s interval: {} samples in {seconds:.1} s",
            usage.torchtools.samples
        );
    });
}

#[test]
fn a_50ms_spike_in_this_process_is_exact_at_a_1s_interval() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tracker = Tracker::start(config(Duration::from_secs(1))).unwrap();
    spike(200);
    let usage = tracker.stop().unwrap();
    let truth = vm_hwm();
    let main = usage.max_ram.main.total_rss;
    assert!(
        within(main, truth, 0.02),
        "main {main} vs VmHWM {truth}: {}",
        usage.torchtools.peak_methods.main
    );
    assert!(main > (200 << 20) as f64);
    assert!(usage.max_ram.descendants.total_rss < (200 << 20) as f64);
    assert!(usage.max_ram.combined.total_rss >= main);
}

#[test]
fn a_thousand_short_lived_children_are_tracked_without_error() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tracker = Tracker::start(config(Duration::from_millis(10))).unwrap();
    for _ in 0..1000 {
        let status = Command::new("true").status().unwrap();
        assert!(status.success());
    }
    let usage = tracker.stop().unwrap();
    assert!(
        usage.torchtools.samples >= 2,
        "{}",
        usage.torchtools.samples
    );
    assert!(usage.compute_time.time > 0.0);
}

#[test]
fn another_process_can_be_tracked_and_a_missing_one_is_an_error() {
    tt_testkit::hang::within(HANG, "tracking another process", || {
        let mut child = Command::new("sleep").arg("0.3").spawn().unwrap();
        let tracker = track_pid(child.id(), Duration::from_millis(20));
        child.wait().unwrap();
        let usage = tracker.stop().unwrap();
        assert!(usage.max_ram.main.total_rss > 0.0);
        let e = Tracker::start(TrackerConfig {
            target: tt_tracker::Target::Pid(u32::MAX - 1),
            ..TrackerConfig::default()
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let e = Tracker::start(config(Duration::from_millis(5)))
            .err()
            .unwrap();
        assert!(e.to_string().contains("10ms"), "{e}");
    });
}

#[test]
fn timelines_hold_every_sample_and_the_blocks() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    // SQLite with the `sqlite` feature (`cargo xtask test` runs both builds).
    let formats: &[&str] = if cfg!(feature = "sqlite") {
        &["csv", "jsonl", "sqlite"]
    } else {
        &["csv", "jsonl"]
    };
    for &ext in formats {
        let path = tmp.path().join(format!("timeline.{ext}"));
        let tracker = Tracker::start(TrackerConfig {
            timeline: Some(path.clone()),
            ..config(Duration::from_millis(10))
        })
        .unwrap();
        let outside = std::time::Instant::now();
        {
            let _b = tracker.block("allocate");
            hold_until_sampled(&tracker, 32);
        }
        let outside = outside.elapsed().as_secs_f64();
        let usage = tracker.stop().unwrap();
        let samples = usage.torchtools.samples as usize;
        let block = &usage.torchtools.blocks[0];
        assert_eq!((block.name.as_str(), block.calls), ("allocate", 1));
        assert!(block.samples >= 1 && block.seconds >= 0.05, "{block:?}");
        // Its time is the time between its start and its stop: within the time
        // measured around it (a millisecond for the clocks' rounding).
        assert!(
            block.seconds <= outside + 1e-3,
            "{block:?}, {outside} s around it"
        );
        assert!(block.measures["main_ram"].max >= (32 << 20) as f64);
        match ext {
            "csv" => {
                let text = std::fs::read_to_string(&path).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                assert!(lines[0].starts_with("ram_unit,gpu_ram_unit,time_unit,"));
                assert!(lines[1].starts_with("bytes,gigabytes,seconds,"));
                assert!(lines[2].starts_with("main_ram,descendants_ram,"));
                assert!(lines[2].ends_with(",timestamp"));
                assert_eq!(lines.len() - 3, samples);
                let blocks =
                    std::fs::read_to_string(tmp.path().join("timeline.blocks.csv")).unwrap();
                let pid = std::process::id();
                assert!(blocks.starts_with("process_id,code_block_name,position,timestamp\n"));
                assert!(blocks.contains(&format!("{pid},allocate,0,")));
                assert!(blocks.contains(&format!("{pid},allocate,1,")));
            }
            "jsonl" => {
                let text = std::fs::read_to_string(&path).unwrap();
                let rows: Vec<serde_json::Value> = text
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect();
                assert!(rows[0]["static_data"]["ram_unit"] == "bytes");
                assert_eq!(
                    rows.iter().filter(|r| r["main_ram"].is_number()).count(),
                    samples
                );
                assert_eq!(rows.iter().filter(|r| r["block"].is_object()).count(), 2);
            }
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                let db = rusqlite::Connection::open(&path).unwrap();
                let n: i64 = db
                    .query_row("SELECT COUNT(*) FROM data", [], |r| r.get(0))
                    .unwrap();
                assert_eq!(n as usize, samples);
                let unit: String = db
                    .query_row("SELECT ram_unit FROM static_data", [], |r| r.get(0))
                    .unwrap();
                assert_eq!(unit, "bytes");
                // Blocks: a sub-tracking file beside it, in gpu_tracker's schema.
                let blocks =
                    rusqlite::Connection::open(tmp.path().join("timeline.blocks.sqlite")).unwrap();
                let events: Vec<(i64, String, i64)> = blocks
                    .prepare("SELECT process_id, code_block_name, position FROM data")
                    .unwrap()
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
                let pid = i64::from(std::process::id());
                assert_eq!(
                    events,
                    [
                        (pid, "allocate".to_owned(), 0),
                        (pid, "allocate".to_owned(), 1)
                    ]
                );
            }
            other => unreachable!("{other}"),
        }
    }
    // Without the feature, a .sqlite timeline is refused before anything is tracked.
    if !cfg!(feature = "sqlite") {
        let path = tmp.path().join("timeline.sqlite");
        let e = tt_tracker::check_timeline_path(&path, false).unwrap_err();
        assert!(e.to_string().contains("`sqlite` feature"), "{e}");
        let e = Tracker::start(TrackerConfig {
            timeline: Some(path.clone()),
            ..TrackerConfig::default()
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("`sqlite` feature"), "{e}");
        assert!(!path.exists());
    }
    // gpu_tracker's own analysis reads our timelines with their blocks, and its
    // `combine` our blocks (given a directory, it combines the files in it).
    for &ext in formats.iter().filter(|&&e| e != "jsonl") {
        let tf = tmp.path().join(format!("timeline.{ext}"));
        let ours = tmp.path().join(format!("blocks_{ext}"));
        std::fs::create_dir(&ours).unwrap();
        let copy = ours.join(format!("timeline.blocks.{ext}"));
        std::fs::copy(tmp.path().join(format!("timeline.blocks.{ext}")), &copy).unwrap();
        let stf = tmp.path().join(format!("combined.{ext}"));
        gpu_tracker(&[
            "sub-track",
            "combine",
            &format!("--stf={}", stf.display()),
            "-p",
            ours.to_str().unwrap(),
        ]);
        let analysis = gpu_tracker(&[
            "sub-track",
            "analyze",
            &format!("--tf={}", tf.display()),
            &format!("--stf={}", stf.display()),
            "--format=json",
        ]);
        let results: serde_json::Value = serde_json::from_str(&analysis).unwrap();
        let block = &results["code_block_results"][0];
        assert_eq!(block["name"], "allocate", "{ext}: {analysis}");
        assert_eq!(block["num_calls"], 1, "{ext}: {analysis}");
        assert!(
            block["compute_time"]["total"].as_f64().unwrap() >= 0.05,
            "{ext}: {analysis}"
        );
    }
    // An existing file is kept unless overwrite is set; a strange extension is refused.
    let existing = tmp.path().join("timeline.csv");
    let e = Tracker::start(TrackerConfig {
        timeline: Some(existing),
        ..TrackerConfig::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("already exists"), "{e}");
    let e = Tracker::start(TrackerConfig {
        timeline: Some(tmp.path().join("t.xlsx")),
        ..TrackerConfig::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("*.csv"), "{e}");
}

#[cfg(feature = "plot")]
#[test]
fn a_plot_is_drawn_with_the_peaks() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let tracker = Tracker::start(TrackerConfig {
        keep_series: true,
        ..config(Duration::from_millis(10))
    })
    .unwrap();
    hold_until_sampled(&tracker, 64);
    hold_until_sampled(&tracker, 1);
    let (_usage, series) = tracker.stop_with_series().unwrap();
    assert!(series.len() >= 3);
    let path = tmp.path().join("usage.svg");
    tt_tracker::plot(&path, &series).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("peak "),
        "{}",
        &svg[..200.min(svg.len())]
    );
}

/// gpu_tracker 5.0.1's command line (installed in the setup venv by `cargo xtask
/// setup`), its stdout. Fails, never skips, without it.
fn gpu_tracker(args: &[&str]) -> String {
    tt_testkit::run_python_module("gpu_tracker", args)
}

/// A Python parent and its forked child sharing 64 MiB (both touched every page), the
/// parent also holding 32 MiB of its own, with 3 extra threads, the child 16 MiB of its
/// own; both say "ready" and wait for stdin to close. Each line goes out in one `write`
/// (atomic on a pipe): `print` writes every piece on its own when `PYTHONUNBUFFERED` is
/// set, as in CI, and the two processes' lines could interleave into one.
const SHARING: &str = r#"
import mmap, os, sys, threading
shared = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)
for i in range(0, 64 << 20, 4096):
    shared[i] = 1
pid = os.fork()
if pid == 0:
    total = sum(shared[i] for i in range(0, 64 << 20, 4096))
    mine = bytearray(b'2' * (16 << 20))
    os.write(1, f'child ready {total}\n'.encode())
    sys.stdin.read()
    os._exit(0)
own = bytearray(32 << 20)
for i in range(0, 32 << 20, 4096):
    own[i] = 1
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads:
    t.start()
os.write(1, b'parent ready\n')
sys.stdin.read()
stop.set()
os.waitpid(pid, 0)
"#;

#[test]
fn private_and_shared_rss_and_threads_are_what_the_processes_hold() {
    tt_testkit::hang::within(HANG, "the shared-memory test", || {
        let mut child = python_child(SHARING);
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        let mut ready = 0;
        while ready < 2 {
            let line = lines
                .next()
                .expect("the program ended before it was ready")
                .unwrap();
            ready += line.matches("ready").count();
        }
        let tracker = track_pid(child.id(), Duration::from_millis(20));
        wait_for_samples(&tracker, 3);
        let usage = tracker.stop().unwrap();
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
        let mib = |x: f64| x / f64::from(1u32 << 20);
        let ram = &usage.max_ram;
        let (main, desc, both) = (&ram.main, &ram.descendants, &ram.combined);
        assert!(
            mib(main.private_rss) >= 32.0,
            "the parent's own 32 MiB: {ram:?}"
        );
        assert!(
            mib(main.shared_rss) >= 64.0 * 0.98,
            "64 MiB shared: {ram:?}"
        );
        assert!(
            mib(desc.shared_rss) >= 64.0 * 0.98,
            "the child maps it too: {ram:?}"
        );
        assert!(
            (16.0..32.0).contains(&mib(desc.private_rss)),
            "the child holds 16 MiB of its own, not the parent's 32: {ram:?}"
        );
        // Shared pages are counted once in the sum of the tree, not once per process.
        assert!(
            both.shared_rss < main.shared_rss + desc.shared_rss - f64::from(48u32 << 20),
            "{ram:?}"
        );
        assert!(both.total_rss <= main.total_rss + desc.total_rss, "{ram:?}");
        // The child's own 16 MiB (held all along) add to the tree's private and total.
        let held = f64::from(15u32 << 20);
        assert!(both.private_rss >= main.private_rss + held, "{ram:?}");
        assert!(
            both.private_rss <= main.private_rss + desc.private_rss,
            "{ram:?}"
        );
        assert!(both.total_rss >= main.total_rss + held, "{ram:?}");
        let cpu = &usage.cpu_utilization;
        assert!(cpu.main_n_threads >= 4, "3 threads + the main one: {cpu:?}");
        assert_eq!(cpu.descendants_n_threads, 1, "{cpu:?}");
        assert_eq!(cpu.combined_n_threads, cpu.main_n_threads + 1, "{cpu:?}");
    });
}

/// A Python parent that says "ready", and on a line from stdin maps 64 MiB shared with
/// a forked child (both touch every page); the child says "shared"; both wait for stdin
/// to close.
const SHARING_LATER: &str = r#"
import mmap, os, sys
print('ready', flush=True)
sys.stdin.readline()
shared = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)
for i in range(0, 64 << 20, 4096):
    shared[i] = 1
pid = os.fork()
if pid == 0:
    total = sum(shared[i] for i in range(0, 64 << 20, 4096))
    print('shared', total, flush=True)
    sys.stdin.read()
    os._exit(0)
sys.stdin.read()
os.waitpid(pid, 0)
"#;

#[test]
fn shared_memory_that_appears_while_tracking_is_seen_within_seconds() {
    // The costly smaps_rollup read is cached per process; a change of RSS must refresh
    // it after a second, not after the ten seconds an unchanged RSS may wait.
    tt_testkit::hang::within(HANG, "the later-sharing test", || {
        let mut child = python_child(SHARING_LATER);
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut expect = |word: &str| {
            let line = lines.next().expect("the program ended early").unwrap();
            assert!(line.starts_with(word), "{line:?}, expected {word:?}");
        };
        expect("ready");
        let tracker = track_pid(child.id(), Duration::from_millis(40));
        wait_for_samples(&tracker, 3);
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        expect("shared");
        // 30 samples: at least 1.2 s, past the one second a cached read may be kept.
        wait_for_samples(&tracker, tracker.samples() + 30);
        let usage = tracker.stop().unwrap();
        drop(stdin);
        assert!(child.wait().unwrap().success());
        let main = &usage.max_ram.main;
        assert!(
            main.shared_rss >= f64::from(63u32 << 20),
            "the 64 MiB shared after tracking began: {main:?}"
        );
    });
}

/// A child that burns 0.6 s of CPU time (whatever the machine's load), then waits.
const BURN: &str = r#"
import sys, time
while time.process_time() < 0.6:
    pass
print('burnt', flush=True)
sys.stdin.read()
"#;

#[test]
fn cpu_utilisation_over_time_adds_up_to_the_cpu_time_used() {
    tt_testkit::hang::within(HANG, "the CPU-time test", || {
        // Percentages times the time between samples must give back the CPU seconds the
        // kernel charged: a rate checked as an amount, so load cannot fail it.
        let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
        let tmp = tempfile::tempdir().unwrap();
        let timeline = tmp.path().join("t.jsonl");
        let mut child = python_child(BURN);
        let tracker = Tracker::start(TrackerConfig {
            target: tt_tracker::Target::Pid(child.id()),
            timeline: Some(timeline.clone()),
            ..config(Duration::from_millis(20))
        })
        .unwrap();
        let out = child.stdout.take().unwrap();
        tt_testkit::wait_for_line(out, "burnt", Duration::from_secs(300));
        let seen = tracker.samples();
        wait_for_samples(&tracker, seen + 2);
        // The kernel's count of the child's CPU time (user + system), in seconds.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let charged =
            (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / hz;
        let usage = tracker.stop().unwrap();
        drop(child.stdin.take());
        child.wait().unwrap();
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(&timeline)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|r: &serde_json::Value| r["timestamp"].is_number())
            .collect();
        let mut integral = 0.0;
        for pair in rows.windows(2) {
            let dt =
                pair[1]["timestamp"].as_f64().unwrap() - pair[0]["timestamp"].as_f64().unwrap();
            integral += pair[1]["cpu_main_sum_utilization_percent"]
                .as_f64()
                .unwrap()
                / 100.0
                * dt;
        }
        assert!(charged >= 0.55, "0.6 s burnt, in clock ticks: {charged}");
        // What the first sample cannot see (the interpreter's start) is at most a little.
        assert!(
            integral >= charged * 0.7 && integral <= charged * 1.1,
            "CPU seconds from the percentages {integral:.3} vs charged {charged:.3}"
        );
        let main = &usage.cpu_utilization.main;
        // One thread: at most 100%, give or take a clock tick over the 100 ms window.
        assert!(main.max_sum_percent <= 120.0, "one thread: {main:?}");
        assert!(main.max_sum_percent > 0.0, "{main:?}");
        // The report's figures are the timeline's: the mean of the samples, the
        // hardware percentages the sums divided by the cores the job was expected to
        // use.
        let column =
            |key: &str| -> Vec<f64> { rows.iter().map(|r| r[key].as_f64().unwrap()).collect() };
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        let sums = column("cpu_main_sum_utilization_percent");
        let hws = column("cpu_main_hardware_utilization_percent");
        let cores = usage.cpu_utilization.n_expected_cores as f64;
        assert!(main.mean_sum_percent > 0.0, "{main:?}");
        assert!(
            near(main.mean_sum_percent, mean(&sums)),
            "{main:?} vs {sums:?}"
        );
        assert!(
            near(main.mean_hardware_percent, mean(&hws)),
            "{main:?} vs {hws:?}"
        );
        assert!(
            near(main.max_hardware_percent, main.max_sum_percent / cores),
            "{main:?}"
        );
        for (s, h) in sums.iter().zip(&hws) {
            assert!(near(*h, s / cores), "{s} / {cores} cores gave {h}");
        }
        // The machine's cores were busy too (at least with this child), never more
        // than all of them.
        let system = &usage.cpu_utilization.system;
        let cores = usage.cpu_utilization.system_core_count as f64;
        assert!(system.max_sum_percent > 0.0, "{system:?}");
        assert!(
            system.max_sum_percent <= cores * 100.0 * 1.05,
            "{cores} cores: {system:?}"
        );
    });
}

/// Reaps the tracked command `pid` (wait4, whose peak must cover the 256 MiB the tests'
/// commands or their children hold), tells the tracker, and stops it.
fn stop_at_exit_with_a_256_mib_peak(
    tracker: Tracker,
    pid: u32,
) -> (tt_tracker::process::Reaped, tt_tracker::ResourceUsage) {
    let reaped = tt_tracker::process::reap(pid).unwrap();
    assert!(reaped.max_rss >= 256 << 20, "{reaped:?}");
    tracker.target_exited(reaped.max_rss, reaped.status);
    (reaped, tracker.stop().unwrap())
}

/// A Python command that says "ready", and on a line from stdin holds 256 MiB for a
/// moment and ends.
const SPIKE_AT_EXIT: &str = r#"
import sys
print('ready', flush=True)
sys.stdin.readline()
b = bytearray(b'1' * (256 << 20))
"#;

#[test]
// The command is reaped by `process::reap` (wait4), whose peak this test checks.
#[allow(clippy::zombie_processes)]
fn wait4s_peak_is_the_commands_when_it_is_the_highest() {
    // The spike comes just before the end: the samples and high-water mark reads see
    // it late or not at all, as a rule. The report gives at least wait4's exact peak
    // whichever way it was seen.
    tt_testkit::hang::within(HANG, "the wait4 exact peak test", || {
        let mut command = python_child(SPIKE_AT_EXIT);
        let out = command.stdout.take().unwrap();
        let mut lines = BufReader::new(out).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "ready");
        let tracker = track_pid(command.id(), Duration::from_millis(20));
        wait_for_samples(&tracker, 3);
        command.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let (reaped, usage) = stop_at_exit_with_a_256_mib_peak(tracker, command.id());
        let (r, peak) = (&usage.max_ram, reaped.max_rss as f64);
        // Never below wait4's exact peak. A sample or high-water mark that caught the
        // spike may read a little above it: the kernel's RSS counters are per-CPU and
        // summed approximately (one CI run: 100 KiB above at 520 MiB).
        assert!(r.main.total_rss >= peak, "wait4 said {peak}: {r:?}");
        assert!(r.main.total_rss <= peak * 1.01, "wait4 said {peak}: {r:?}");
        assert_eq!(r.descendants.total_rss, 0.0, "{r:?}");
        assert!(r.combined.total_rss >= r.main.total_rss, "{r:?}");
    });
}

/// A Python command whose child holds 256 MiB, says "ready" and waits for stdin to
/// close; the command reaps it, then ends.
const BIG_CHILD: &str = r#"
import subprocess, sys
child = "import sys\nb = bytearray(b'1' * (256 << 20))\nprint('ready', flush=True)\nsys.stdin.read()"
subprocess.run([sys.executable, '-c', child])
"#;

#[test]
// The command is reaped by `process::reap` (wait4), whose peak this test checks.
#[allow(clippy::zombie_processes)]
fn wait4s_peak_is_the_commands_only_when_no_descendant_reached_it() {
    // wait4's ru_maxrss is the largest of the command and the descendants it reaped:
    // here the child's 256 MiB, which must not be taken for the command's own.
    tt_testkit::hang::within(HANG, "the wait4 peak test", || {
        let mut command = python_child(BIG_CHILD);
        let tracker = track_pid(command.id(), Duration::from_millis(20));
        let out = command.stdout.take().unwrap();
        tt_testkit::wait_for_line(out, "ready", Duration::from_secs(300));
        // 60 samples (at least 1.2 s): a full walk has read the child's high-water mark.
        wait_for_samples(&tracker, tracker.samples() + 60);
        drop(command.stdin.take());
        let (_, usage) = stop_at_exit_with_a_256_mib_peak(tracker, command.id());
        let (r, methods) = (&usage.max_ram, &usage.torchtools.peak_methods);
        let mib = |x: f64| x / f64::from(1u32 << 20);
        assert!(mib(r.descendants.total_rss) >= 256.0, "{r:?} {methods:?}");
        assert!(
            mib(r.main.total_rss) < 128.0,
            "the child's peak is not the command's: {r:?}"
        );
        assert!(!methods.main.starts_with("wait4"), "{methods:?}");
        assert_eq!(usage.torchtools.exit_status, Some(0));
    });
}

/// A Python command that held 256 MiB and gave them back, with a child that did the
/// same; both then say "ready" and wait for stdin to close.
const PEAKED_BEFORE: &str = r#"
import subprocess, sys
b = bytearray(b'1' * (256 << 20)); del b
child = "import sys\nb = bytearray(b'1' * (256 << 20)); del b\nprint('ready', flush=True)\nsys.stdin.read()"
subprocess.run([sys.executable, '-c', child])
"#;

#[test]
fn peaks_from_before_tracking_are_not_reported() {
    // Both processes' high-water marks are reset when tracking starts: what they held
    // before is not the tracked peak.
    tt_testkit::hang::within(HANG, "the peaks-before test", || {
        let mut command = python_child(PEAKED_BEFORE);
        let out = command.stdout.take().unwrap();
        tt_testkit::wait_for_line(out, "ready", Duration::from_secs(300));
        let tracker = track_pid(command.id(), Duration::from_millis(20));
        // 60 samples (at least 1.2 s): a full walk has read the child's high-water mark.
        wait_for_samples(&tracker, 60);
        let usage = tracker.stop().unwrap();
        drop(command.stdin.take());
        assert!(command.wait().unwrap().success());
        let (r, methods) = (&usage.max_ram, &usage.torchtools.peak_methods);
        let mib = |x: f64| x / f64::from(1u32 << 20);
        assert!(mib(r.main.total_rss) < 128.0, "{r:?} {methods:?}");
        assert!(mib(r.descendants.total_rss) < 128.0, "{r:?} {methods:?}");
        assert!(r.descendants.total_rss > 0.0, "the child was seen: {r:?}");
    });
}

#[test]
fn a_dropped_tracker_stops_sampling() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.jsonl");
    let tracker = Tracker::start(TrackerConfig {
        timeline: Some(path.clone()),
        ..config(Duration::from_millis(10))
    })
    .unwrap();
    wait_for_samples(&tracker, 3);
    drop(tracker);
    let lines = std::fs::read_to_string(&path).unwrap().lines().count();
    // Another tracker's 20 samples as the clock (at least 200 ms): the first one's
    // timeline stays as it was.
    let clock = Tracker::start(config(Duration::from_millis(10))).unwrap();
    wait_for_samples(&clock, 20);
    drop(clock);
    let after = std::fs::read_to_string(&path).unwrap();
    assert_eq!(after.lines().count(), lines, "still sampling after drop");
    assert!(after.ends_with('\n'), "the last line written whole");
}

/// A Python command whose second thread forks a child that holds 48 MiB, says "child
/// ready" and waits for stdin to close.
const THREAD_CHILD: &str = r#"
import os, sys, threading
def fork():
    pid = os.fork()
    if pid == 0:
        b = bytearray(b'1' * (48 << 20))
        print('child ready', flush=True)
        sys.stdin.read()
        os._exit(0)
    os.waitpid(pid, 0)
t = threading.Thread(target=fork)
t.start()
t.join()
"#;

/// A child forked by a thread other than the main one is listed only under that thread
/// (`/proc/PID/task/TID/children`), which the tracker reads about once a second; in
/// between it keeps the descendants it found. Every sample counts the child's memory.
#[test]
fn a_child_of_another_thread_is_counted_in_every_sample() {
    tt_testkit::hang::within(HANG, "the other thread's child test", || {
        let mut command = python_child(THREAD_CHILD);
        let out = command.stdout.take().unwrap();
        let mut lines = BufReader::new(out).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "child ready");
        let tmp = tempfile::tempdir().unwrap();
        let timeline = tmp.path().join("t.jsonl");
        let tracker = Tracker::start(TrackerConfig {
            target: tt_tracker::Target::Pid(command.id()),
            timeline: Some(timeline.clone()),
            ..config(Duration::from_millis(20))
        })
        .unwrap();
        // 60 samples: over a second, so cheap samples lie between full listings.
        wait_for_samples(&tracker, 60);
        let usage = tracker.stop().unwrap();
        drop(command.stdin.take());
        assert!(command.wait().unwrap().success());
        let text = std::fs::read_to_string(&timeline).unwrap();
        let mut samples = 0u64;
        for line in text.lines() {
            let r: serde_json::Value = serde_json::from_str(line).unwrap();
            let Some(desc) = r["descendants_ram"].as_f64() else {
                continue;
            };
            assert!(desc >= f64::from(48u32 << 20), "sample {samples}: {line}");
            samples += 1;
        }
        assert_eq!(samples, usage.torchtools.samples, "{text}");
    });
}

#[test]
fn a_descendants_cpu_use_is_its_own_not_the_tracked_processs() {
    tt_testkit::hang::within(HANG, "the descendant CPU test", || {
        // The tracked Python only waits for its child, which burns 0.6 s of CPU.
        let parent =
            format!("import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN:?}])");
        let mut child = python_child(&parent);
        let tmp = tempfile::tempdir().unwrap();
        let timeline = tmp.path().join("t.jsonl");
        let tracker = Tracker::start(TrackerConfig {
            target: tt_tracker::Target::Pid(child.id()),
            timeline: Some(timeline.clone()),
            ..config(Duration::from_millis(20))
        })
        .unwrap();
        let out = child.stdout.take().unwrap();
        tt_testkit::wait_for_line(out, "burnt", Duration::from_secs(300));
        let seen = tracker.samples();
        wait_for_samples(&tracker, seen + 2);
        let usage = tracker.stop().unwrap();
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
        let cpu = &usage.cpu_utilization;
        // (A busy machine may give the burning child less than a core: any share.)
        assert!(cpu.descendants.max_sum_percent > 10.0, "{cpu:?}");
        assert!(cpu.descendants.mean_sum_percent > 0.0, "{cpu:?}");
        assert!(
            cpu.combined.max_sum_percent >= cpu.descendants.max_sum_percent,
            "{cpu:?}"
        );
        // Sample by sample, the tree's use is the command's plus its descendants'; over
        // time (percent x seconds: CPU seconds, whatever the load), the 0.6 s burnt are
        // the descendant's, and the waiting command's own start is far less.
        let text = std::fs::read_to_string(&timeline).unwrap();
        let (mut samples, mut last_t) = (0, None);
        let (mut main_s, mut desc_s) = (0.0, 0.0);
        for line in text.lines() {
            let r: serde_json::Value = serde_json::from_str(line).unwrap();
            let Some(both) = r["cpu_combined_sum_utilization_percent"].as_f64() else {
                continue;
            };
            let main = r["cpu_main_sum_utilization_percent"].as_f64().unwrap();
            let desc = r["cpu_descendants_sum_utilization_percent"]
                .as_f64()
                .unwrap();
            assert!((both - (main + desc)).abs() < 1e-9, "{line}");
            let t = r["timestamp"].as_f64().unwrap();
            if let Some(before) = last_t.replace(t) {
                main_s += main / 100.0 * (t - before);
                desc_s += desc / 100.0 * (t - before);
            }
            samples += 1;
        }
        assert!(samples >= 2, "{text}");
        assert!(
            desc_s >= 0.4,
            "the child's 0.6 s: {desc_s:.3} s (command {main_s:.3} s)"
        );
        assert!(
            main_s < desc_s / 2.0,
            "the command only waits: {main_s:.3} s, its child {desc_s:.3} s"
        );
    });
}

#[test]
fn a_timeline_path_is_checked_before_anything_is_tracked() {
    let tmp = tempfile::tempdir().unwrap();
    let check = |path: &std::path::Path, overwrite: bool| {
        tt_tracker::check_timeline_path(path, overwrite).map_err(|e| e.to_string())
    };
    // A directory that does not exist, absolute or relative.
    let missing = tmp.path().join("no-such-dir").join("t.csv");
    let e = check(&missing, false).unwrap_err();
    assert!(e.contains("does not exist"), "{e}");
    let e = check(std::path::Path::new("no-such-dir-here/t.csv"), false).unwrap_err();
    assert!(e.contains("does not exist"), "{e}");
    // A directory itself, an unknown extension.
    assert!(check(tmp.path(), false).unwrap_err().contains("directory"));
    assert!(check(&tmp.path().join("t.txt"), false).is_err());
    // An existing file only with overwrite; a new file in an existing directory.
    let existing = tmp.path().join("t.csv");
    std::fs::write(&existing, "").unwrap();
    assert!(check(&existing, false).is_err());
    assert!(check(&existing, true).is_ok());
    assert!(check(&tmp.path().join("new.csv"), false).is_ok());
    // A bare file name: in the current directory.
    assert!(check(std::path::Path::new("no-timeline-here-yet.csv"), false).is_ok());
    // And the tracker refuses the missing directory before it starts.
    let e = Tracker::start(TrackerConfig {
        timeline: Some(missing.clone()),
        ..TrackerConfig::default()
    })
    .err()
    .expect("a timeline in a missing directory");
    assert!(e.to_string().contains("does not exist"), "{e}");
}

/// Without the `sqlite` feature (the CI matrix's no-features step), a `.sqlite`
/// timeline is refused before tracking starts, saying how to get it.
#[cfg(not(feature = "sqlite"))]
#[test]
fn a_sqlite_timeline_needs_the_feature_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("t.sqlite");
    let e = tt_tracker::check_timeline_path(&path, false).unwrap_err();
    assert!(e.to_string().contains("`sqlite` feature"), "{e}");
    let e = Tracker::start(TrackerConfig {
        timeline: Some(path.clone()),
        ..TrackerConfig::default()
    })
    .err()
    .expect("a .sqlite timeline without the feature");
    assert!(e.to_string().contains("`sqlite` feature"), "{e}");
    assert!(!path.exists());
    // The other formats are fine.
    assert!(tt_tracker::check_timeline_path(&tmp.path().join("t.csv"), false).is_ok());
}

#[test]
fn a_timeline_path_that_is_a_dangling_symlink_is_refused_as_existing() {
    // Never written through: the link could point anywhere (another user's file in
    // /tmp). Without overwrite, the tracker says the file exists.
    let tmp = tempfile::tempdir().unwrap();
    let link = tmp.path().join("t.csv");
    std::os::unix::fs::symlink(tmp.path().join("elsewhere.csv"), &link).unwrap();
    let e = Tracker::start(TrackerConfig {
        timeline: Some(link.clone()),
        ..TrackerConfig::default()
    })
    .err()
    .expect("a timeline at a dangling symbolic link");
    assert!(
        matches!(&e, tt_tracker::Error::TimelineExists { path } if *path == link),
        "{e:?}"
    );
    assert!(
        !tmp.path().join("elsewhere.csv").exists(),
        "written through the link"
    );
}

#[test]
fn the_series_kept_for_a_plot_has_a_point_per_sample_in_time_order() {
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tracker = Tracker::start(TrackerConfig {
        keep_series: true,
        ..config(Duration::from_millis(10))
    })
    .unwrap();
    hold_until_sampled(&tracker, 32);
    wait_for_samples(&tracker, 20);
    let (usage, series) = tracker.stop_with_series().unwrap();
    // Far below the 4096 points kept before neighbours merge: one point per sample.
    assert_eq!(series.len() as u64, usage.torchtools.samples);
    assert!(series.windows(2).all(|w| w[0].t < w[1].t), "{series:?}");
    assert!(series.iter().all(|p| p.ram > 0.0 && p.cpu >= 0.0));
    let peak = series.iter().map(|p| p.ram).fold(0.0, f64::max);
    assert!(peak >= (32 << 20) as f64, "the 32 MiB held: {peak}");
    // Without `keep_series`, none is kept.
    let tracker = Tracker::start(config(Duration::from_millis(10))).unwrap();
    wait_for_samples(&tracker, 2);
    assert!(tracker.stop_with_series().unwrap().1.is_empty());
}

#[test]
fn samples_are_of_the_live_process_only_none_after_it_exits() {
    // gpu_tracker's readers would otherwise see a minimum of 0 RAM and 0 threads.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("timeline.jsonl");
    let mut child = Command::new("sleep").arg("600").spawn().unwrap();
    let tracker = Tracker::start(TrackerConfig {
        target: tt_tracker::Target::Pid(child.id()),
        timeline: Some(path.clone()),
        ..config(Duration::from_millis(20))
    })
    .unwrap();
    wait_for_samples(&tracker, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    // The last sample, taken by stop, finds the process gone: it is not recorded.
    let usage = tracker.stop().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let samples: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["main_ram"].is_number())
        .collect();
    assert_eq!(samples.len() as u64, usage.torchtools.samples);
    assert!(samples.len() >= 2);
    for s in &samples {
        assert!(s["main_n_threads"].as_f64().unwrap() >= 1.0, "{s}");
        assert!(s["main_ram"].as_f64().unwrap() > 0.0, "{s}");
    }
}

#[test]
fn the_system_ram_is_read_again_while_tracking_not_only_at_the_ends() {
    fn mem_available() -> String {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap();
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"));
        line.unwrap_or_default().to_string()
    }
    let _turn = THIS_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("timeline.jsonl");
    let tracker = Tracker::start(TrackerConfig {
        timeline: Some(path.clone()),
        ..config(Duration::from_millis(10))
    })
    .unwrap();
    // The first system reading is behind us; then 64 MiB held until the kernel's
    // MemAvailable shows a change (it is folded from per-CPU counters lazily: on a
    // busy machine that takes a while), then over the samples below.
    wait_for_samples(&tracker, 1);
    let before = mem_available();
    let mut v = vec![0u8; 64 << 20];
    for page in v.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&v);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while mem_available() == before {
        assert!(
            std::time::Instant::now() < deadline,
            "MemAvailable never changed with 64 MiB touched"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Then 40 samples: by the sampler's own schedule (each tick is planned at least an
    // interval after the one before, however late it runs) they span 390 ms or more,
    // three times the 100 ms between two system readings, whatever the machine's load
    // (the test used to wait 15 samples and 250 ms of wall time: a fresh-clone run on a
    // busy machine once saw one reading for all 32 samples).
    wait_for_samples(&tracker, tracker.samples() + 40);
    drop(v);
    let _ = tracker.stop().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let samples: Vec<(f64, f64)> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["timestamp"].as_f64()?, r["system_ram"].as_f64()?)))
        .collect();
    let mut system: Vec<f64> = samples.iter().map(|(_, ram)| *ram).collect();
    system.pop(); // the last sample, taken by stop, reads the system anyway
    system.dedup();
    assert!(
        system.len() >= 2,
        "one system reading for all {} samples (MemAvailable went from {before:?}); \
         the samples' (time, system RAM): {samples:?}",
        samples.len()
    );
}

/// A tracked process that has exited but is not reaped yet (a zombie) is not sampled:
/// such a row (no memory, one thread) gave gpu_tracker's `sub-track analyze` a minimum
/// RAM of 0.
#[test]
fn a_process_that_has_exited_is_not_sampled() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("timeline.csv");
    let mut child = Command::new("sh")
        .args(["-c", "x=$(seq 1 20000); sleep 0.3"])
        .spawn()
        .unwrap();
    let tracker = Tracker::start(TrackerConfig {
        timeline: Some(path.clone()),
        target: tt_tracker::Target::Pid(child.id()),
        ..config(Duration::from_millis(10))
    })
    .unwrap();
    // Until it has exited (not reaped), then while it stays a zombie.
    tt_tracker::process::wait_for_exit(child.id(), None).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let usage = tracker.stop().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines().skip(2);
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (ram, threads) = (col("main_ram"), col("main_n_threads"));
    let rows: Vec<Vec<f64>> = lines
        .map(|l| {
            l.split(',')
                .map(|v| v.parse().unwrap_or(f64::NAN))
                .collect()
        })
        .collect();
    assert!(!rows.is_empty(), "no sample while it ran: {usage:?}");
    for row in &rows {
        assert!(
            row[ram] > 0.0 && row[threads] >= 1.0,
            "a row of the exited process: {row:?}"
        );
    }
}
