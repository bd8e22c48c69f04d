//! `cargo bench -p tt-lock` (and `cargo xtask bench`): lock latencies against the
//! issue's goals (uncontended acquire + release ≤ 20 µs median, hand-off ≤ 1 ms median)
//! and against the Python torchtools' way (`open` + `fcntl.flock` + unlock).
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{GpuKey, Holder, LockDir, Wait};

const UNCONTENDED: usize = 5_000;
const HANDOFFS: usize = 200;

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for clock_gettime to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

use tt_testkit::bench::median;

/// The waiter process: for each line `block` or `timeout` on stdin, lock (blocking or
/// timed), print the monotonic time it got the lock, release.
fn waiter(dir: &LockDir) {
    let key = GpuKey::Index(0);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return };
        let wait = match line.trim() {
            "block" => Wait::Block,
            _ => Wait::Timeout(Duration::from_secs(60)),
        };
        let lock = dir.lock(&key, wait, Holder::current()).expect("lock");
        let got = monotonic_ns();
        drop(lock);
        writeln!(out, "{got}")
            .and_then(|()| out.flush())
            .expect("pipe");
    }
}

/// Median hand-off in µs: this process holds the lock, the waiter blocks on it, this
/// process releases; time from release to the waiter holding it.
fn handoff(dir: &LockDir, mode: &str) -> f64 {
    let exe = std::env::current_exe().expect("exe");
    let mut child = Command::new(exe)
        .arg("--waiter")
        .env("TT_LOCK_BENCH_DIR", dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the waiter");
    let mut to = child.stdin.take().expect("stdin");
    let mut from = BufReader::new(child.stdout.take().expect("stdout"));
    let key = GpuKey::Index(0);
    let mut times = Vec::with_capacity(HANDOFFS);
    for _ in 0..HANDOFFS {
        let lock = dir
            .lock(&key, Wait::Block, Holder::current())
            .expect("lock");
        writeln!(to, "{mode}")
            .and_then(|()| to.flush())
            .expect("pipe");
        std::thread::sleep(Duration::from_millis(5)); // the waiter is now waiting
        let released = monotonic_ns();
        drop(lock);
        let mut line = String::new();
        from.read_line(&mut line).expect("waiter");
        let got: u64 = line.trim().parse().expect("a time");
        times.push(got.saturating_sub(released) as f64 / 1e3);
    }
    drop(to);
    let _ = child.wait();
    median(times)
}

fn python_flock_us(dir: &LockDir) -> Option<f64> {
    let py = std::env::var("TORCHTOOLS_PYTHON").ok()?;
    let script = format!(
        "import fcntl, os, time\n\
         p = {:?}\n\
         ts = []\n\
         for _ in range(5000):\n\
         \x20   t = time.perf_counter()\n\
         \x20   f = open(p, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); fcntl.flock(f, fcntl.LOCK_UN); f.close()\n\
         \x20   ts.append(time.perf_counter() - t)\n\
         print(sorted(ts)[len(ts)//2] * 1e6)\n",
        dir.path().join("python.lock").display().to_string()
    );
    let out = Command::new(py).args(["-c", &script]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn main() {
    let tmp = tempfile::tempdir().expect("tempdir");
    if std::env::args().any(|a| a == "--waiter") {
        let dir = LockDir::open(std::env::var("TT_LOCK_BENCH_DIR").expect("dir")).expect("dir");
        waiter(&dir);
        return;
    }
    let dir = LockDir::open(tmp.path().join("locks")).expect("lock dir");
    let key = GpuKey::Index(1);
    let holder = Holder::current();
    let mut times = Vec::with_capacity(UNCONTENDED);
    for _ in 0..UNCONTENDED {
        let h = holder.clone();
        let start = Instant::now();
        let lock = dir.lock(&key, Wait::Try, h).expect("uncontended");
        drop(lock);
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    let acquire = median(times);
    let blocked = handoff(&dir, "block");
    let timed = handoff(&dir, "timeout");

    println!("tt-lock ({UNCONTENDED} uncontended rounds, {HANDOFFS} hand-offs to another process)");
    println!("  acquire + release (open, queue check, flock, holder record, unlock, close): {acquire:.1} µs");
    println!("  hand-off to a blocked waiter: {blocked:.1} µs; to a timed waiter: {timed:.1} µs");
    println!("row|GPU lock acquire+release, uncontended (µs)|{acquire:.1}|goal|20.0|µs|lower");
    if let Some(py) = python_flock_us(&dir) {
        println!("  python open + fcntl.flock + unlock (the Python torchtools' way, no record): {py:.1} µs");
        println!("row|GPU lock acquire+release, uncontended (µs)|{acquire:.1}|Python open + fcntl.flock + unlock|{py:.1}|µs|lower");
    }
    println!("row|lock hand-off to the next blocked waiter in line (µs)|{blocked:.1}|goal|1000.0|µs|lower");
    println!(
        "row|lock hand-off to the next timed waiter in line (µs)|{timed:.1}|goal|1000.0|µs|lower"
    );
}
