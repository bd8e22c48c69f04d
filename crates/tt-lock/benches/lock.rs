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

/// Waiting requests and usage records of the queue-decision row.
const WAITERS: usize = 1_000;
const USAGE_RECORDS: usize = 100_000;
const DECISIONS: usize = 50;

/// Median time of one request's decision (a `Wait::Try` of a free GPU, granted and let
/// go) in `dir`, in µs.
fn decision_us(dir: &LockDir, rounds: usize) -> f64 {
    let key = GpuKey::Index(1);
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let lock = dir
            .lock(&key, Wait::Try, Holder::current())
            .expect("a free GPU");
        times.push(start.elapsed().as_secs_f64() * 1e6);
        drop(lock);
    }
    median(times)
}

/// The lock directory of the queue-decision row: `WAITERS` live requests for GPU 0
/// (each ticket write-locked by this process, as a waiting process holds its own), and
/// `USAGE_RECORDS` reservations in three users' names in this user's log (a reader
/// checks names against owners, so all are this user's here: the cost is the same).
/// Returns the open tickets, which keep the requests live.
fn crowded(path: &std::path::Path) -> Vec<std::fs::File> {
    use std::os::fd::AsRawFd;
    let dir = LockDir::open(path).expect("lock dir");
    let me = Holder::current();
    let now = tt_device::now_unix();
    let mut log = String::with_capacity(USAGE_RECORDS * 400);
    for i in 0..USAGE_RECORDS {
        let start = now - 7.0 * 86_400.0 + i as f64 * 5.0;
        log.push_str(&format!(
            "{{\"event\":\"start\",\"id\":\"r{i}\",\"user\":\"{u}\",\"host\":\"h\",\"pid\":{i},\
             \"gpu\":\"index {g}\",\"bytes\":null,\"time\":{start},\"command\":[\"python\",\"train.py\"]}}\n\
             {{\"event\":\"end\",\"id\":\"r{i}\",\"time\":{end},\"status\":0}}\n",
            u = me.who.user,
            g = i % 8,
            end = start + 4.0
        ));
    }
    let uid = nix::unistd::geteuid().as_raw();
    std::fs::write(dir.usage_log_path(uid), log).expect("usage log");
    let mut tickets = Vec::with_capacity(WAITERS);
    for t in 1..=WAITERS {
        let path = path.join(format!("wait-{t:020}.json"));
        let line = format!(
            "{{\"ticket\":{t},\"pid\":{},\"user\":\"{}\",\"host\":\"h\",\"since_unix\":{},\
             \"wants\":{{\"kind\":\"gpus\",\"gpus\":[{{\"index\":0}}]}}}}\n",
            std::process::id(),
            me.who.user,
            me.who.since_unix
        );
        std::fs::write(&path, line).expect("ticket");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("ticket");
        let lock = libc::flock {
            l_type: libc::F_WRLCK as i16,
            l_whence: libc::SEEK_SET as i16,
            l_start: 0,
            l_len: 0,
            l_pid: 0,
        };
        // SAFETY: F_OFD_SETLK with a valid flock struct on an open descriptor.
        let done = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
        assert_eq!(done, 0, "locking a ticket");
        tickets.push(file);
    }
    tickets
}

/// The queue's decision with `WAITERS` requests waiting and `USAGE_RECORDS` usage
/// records under a fair-share policy, against a request today with neither.
fn queue_decision(tmp: &std::path::Path) {
    // Each ticket is an open file: room for them all.
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let empty = LockDir::open(tmp.join("empty")).expect("lock dir");
    let alone = decision_us(&empty, DECISIONS * 10);
    let _tickets = crowded(&tmp.join("crowded"));
    let crowded = LockDir::open(tmp.join("crowded")).expect("lock dir");
    let fcfs = decision_us(&crowded, DECISIONS);
    let policy = tmp.join("policy.toml");
    std::fs::write(
        &policy,
        "[fair_share]\nhalf_life = \"7d\"\n[limits]\ngpus = 8\n",
    )
    .expect("policy");
    std::env::set_var(tt_lock::POLICY_ENV, &policy);
    // A process's first decision reads every usage log whole; later ones what was
    // appended since.
    let cold = decision_us(&LockDir::open(tmp.join("crowded")).expect("lock dir"), 1);
    let fair = decision_us(&crowded, DECISIONS);
    std::env::remove_var(tt_lock::POLICY_ENV);
    println!(
        "  a request's decision: {alone:.0} µs alone; with {WAITERS} waiting and \
         {USAGE_RECORDS} usage records: {fcfs:.0} µs first come, first served, {fair:.0} µs \
         by fair share and limits ({cold:.0} µs for a process's first, which reads the \
         usage logs whole)"
    );
    println!(
        "row|queue decision, {WAITERS} waiting + {USAGE_RECORDS} usage records, fair share (µs)|{fair:.0}|a request alone, no policy|{alone:.0}|µs|lower"
    );
    println!(
        "row|queue decision, {WAITERS} waiting + {USAGE_RECORDS} usage records, fair share (µs)|{fair:.0}|the same queue first come, first served|{fcfs:.0}|µs|lower"
    );
}

/// Records of a year of a busy lab (ten users' reservations of eight GPUs), and the
/// open records one user's junk holds (issue 76's attack: 400,000, 44 MB).
const YEAR_RECORDS: usize = 1_000_000;
const JUNK_RECORDS: usize = 400_000;

/// Writes `records` reservations (start and end, or open with `open`) into the log
/// at `path`, in this user's name, spread over the `span` seconds before now; with
/// `summarized`, summarized as `torchtools reserve` does under fair share (every
/// thousand reservations here, with the bench's half-life).
fn write_log(
    path: &std::path::Path,
    records: usize,
    span: f64,
    open: bool,
    summarized: Option<&LockDir>,
) {
    let me = Holder::current().who.user;
    write_log_of(&me, path, records, span, open, summarized);
}

/// [`write_log`] in `me`'s name.
fn write_log_of(
    me: &str,
    path: &std::path::Path,
    records: usize,
    span: f64,
    open: bool,
    summarized: Option<&LockDir>,
) {
    use std::io::Write as _;
    let now = tt_device::now_unix();
    // Appending, as every writer of a log does: the summaries are appended beside.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("log");
    let mut out = std::io::BufWriter::new(file);
    for i in 0..records {
        let start = now - span + span * i as f64 / records as f64;
        writeln!(
            out,
            "{{\"event\":\"start\",\"id\":\"h/0/{i}/g/{i}\",\"user\":\"{me}\",\"host\":\"h\",\
             \"pid\":{i},\"gpu\":\"index {g}\",\"bytes\":null,\"time\":{start},\
             \"command\":[\"python\",\"train.py\",\"--lr\",\"0.1\"]}}",
            g = i % 8
        )
        .expect("log");
        if !open {
            writeln!(
                out,
                "{{\"event\":\"end\",\"id\":\"h/0/{i}/g/{i}\",\"time\":{},\"status\":0}}",
                start + 0.9 * span / records as f64
            )
            .expect("log");
        }
        if let Some(dir) = summarized.filter(|_| i % 1000 == 999) {
            out.flush().expect("log");
            dir.summarize_own_usage(HALF_LIFE).expect("summary");
        }
    }
}

/// The bench policy's half-life.
const HALF_LIFE: Duration = Duration::from_secs(7 * 86_400);

/// The child side of [`history_decision`]: one process's decisions in the lock
/// directory `TT_LOCK_BENCH_DIR` under the fair-share policy of `TORCHTOOLS_POLICY`;
/// prints the first's and the median later one's time (ms) and the peak memory (KiB).
fn decide() {
    let dir = LockDir::open(std::env::var("TT_LOCK_BENCH_DIR").expect("dir")).expect("dir");
    let first = decision_us(&dir, 1) / 1e3;
    let later = decision_us(&dir, 20) / 1e3;
    // SAFETY: getrusage with a valid struct to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    println!("{first} {later} {}", usage.ru_maxrss);
}

/// This bench run again as a child in `mode` (`--decide`, `--totals`, ...) in the
/// lock directory `dir`, with `env` set: the `count` numbers it prints.
fn child_numbers(
    mode: &str,
    dir: &LockDir,
    env: &[(&str, &std::path::Path)],
    count: usize,
) -> Vec<f64> {
    let out = Command::new(std::env::current_exe().expect("exe"))
        .arg(mode)
        .env("TT_LOCK_BENCH_DIR", dir.path())
        .envs(env.iter().copied())
        .stderr(Stdio::null())
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(v.len(), count, "{mode}: {text}");
    v
}

/// A request's decision under a fair-share policy in a fresh process (which reads the
/// usage logs once) and later ones, with a year of history, and with one user's junk
/// beside a small history: each in a process of its own, for its peak memory.
fn history_decision(tmp: &std::path::Path) {
    let uid = nix::unistd::geteuid().as_raw();
    let policy = tmp.join("history-policy.toml");
    // Limits too: a request then reads the standings even with nobody waiting.
    std::fs::write(
        &policy,
        "[fair_share]\nhalf_life = \"7d\"\n[limits]\ngpus = 8\n",
    )
    .expect("policy");
    let year = LockDir::open(tmp.join("year")).expect("dir");
    write_log(
        &year.usage_log_path(uid),
        YEAR_RECORDS,
        365.0 * 86_400.0,
        false,
        Some(&year),
    );
    let junk = LockDir::open(tmp.join("junk")).expect("dir");
    write_log(
        &junk.usage_log_path(uid),
        1_000,
        7.0 * 86_400.0,
        false,
        Some(&junk),
    );
    // Junk nobody summarizes, in another user's log (as root: `nobody`'s, as the
    // issue's vandal; otherwise the bench's own, whose reading is then its owner's).
    let vandal = if uid == 0 { 65_534 } else { uid };
    let junk_log = junk.path().join(format!("usage-{vandal}.7.jsonl"));
    let vandal_name = nix::unistd::User::from_uid(vandal.into())
        .ok()
        .flatten()
        .map_or_else(|| vandal.to_string(), |u| u.name);
    write_log_of(&vandal_name, &junk_log, JUNK_RECORDS, 86_400.0, true, None);
    if vandal != uid {
        nix::unistd::chown(&junk_log, Some(vandal.into()), None).expect("chown");
    }
    let small = LockDir::open(tmp.join("small")).expect("dir");
    write_log(
        &small.usage_log_path(uid),
        1_000,
        7.0 * 86_400.0,
        false,
        Some(&small),
    );
    // Each process keeps its tally for the next in this user's cache: here the bench's.
    let cache = tmp.join("cache");
    let measure = |dir: &LockDir| -> (f64, f64, f64) {
        let env = [
            ("XDG_CACHE_HOME", cache.as_path()),
            (tt_lock::POLICY_ENV, policy.as_path()),
        ];
        let v = child_numbers("--decide", dir, &env, 3);
        (v[0], v[1], v[2] / 1024.0)
    };
    let (s_first, s_later, s_mib) = measure(&small);
    let (y_first, y_later, y_mib) = measure(&year);
    let (j_first, j_later, j_mib) = measure(&junk);
    // The next process of the same user: from the tally the first one kept.
    let (y_kept, _, y_kept_mib) = measure(&year);
    let (j_kept, _, j_kept_mib) = measure(&junk);
    println!(
        "  a user's next process, from the tally the first kept: a year {y_kept:.1} ms, \
         {y_kept_mib:.0} MiB; the junk {j_kept:.1} ms, {j_kept_mib:.0} MiB"
    );
    println!(
        "  a process's decisions under fair share (first, which reads the logs; later, \
         median; peak memory): 1,000 records {s_first:.1} ms, {s_later:.2} ms, {s_mib:.0} MiB; \
         a year ({YEAR_RECORDS} records) {y_first:.0} ms, {y_later:.2} ms, {y_mib:.0} MiB; \
         one user's {JUNK_RECORDS} open records of junk {j_first:.0} ms, {j_later:.2} ms, {j_mib:.0} MiB"
    );
    for (what, first, later, mib, kept, kept_mib) in [
        (
            format!("a year of history ({YEAR_RECORDS} usage records)"),
            y_first,
            y_later,
            y_mib,
            y_kept,
            y_kept_mib,
        ),
        (
            format!("one user's junk ({JUNK_RECORDS} open records)"),
            j_first,
            j_later,
            j_mib,
            j_kept,
            j_kept_mib,
        ),
    ] {
        println!("row|a process's first decision, {what}, the user's tally kept (ms)|{kept:.1}|goal|20.0|ms|lower");
        println!("row|a process's first decision, {what}, nothing kept (ms)|{first:.1}|the same, 1,000 records|{s_first:.1}|ms|lower");
        println!("row|a process's first decision, {what}, nothing kept (ms)|{first:.1}|goal|20.0|ms|lower");
        println!("row|a later decision, {what} (ms)|{later:.2}|the same, 1,000 records|{s_later:.2}|ms|lower");
        println!("row|peak memory of a deciding process, {what} (MiB)|{mib:.0}|goal|64|MiB|lower");
        println!("row|peak memory of a deciding process, {what}, the user's tally kept (MiB)|{kept_mib:.0}|goal|64|MiB|lower");
    }
    usage_totals(&year);
}

/// The child side of the totals rows: `usage`'s reading of the lock directory
/// `TT_LOCK_BENCH_DIR`, summed as a stream (`--totals`) or every record kept
/// (`--records`, `LockDir::usage`); prints its time (ms) and the peak memory (KiB).
fn read_usage(streamed: bool) {
    let dir = LockDir::open(std::env::var("TT_LOCK_BENCH_DIR").expect("dir")).expect("dir");
    if std::env::args().any(|a| a == "--watch") {
        // `serve`'s reading: the first reads everything, the next what was appended.
        let mut watch = tt_lock::UsageWatch::new(Duration::from_secs(7 * 86_400));
        let week = [Duration::from_secs(86_400), Duration::from_secs(7 * 86_400)];
        let start = Instant::now();
        watch.read(&dir, &week).expect("watch");
        let first = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        let sums = watch.read(&dir, &week).expect("watch");
        let later = start.elapsed().as_secs_f64() * 1e3;
        assert!(!sums.windows[0].by_user.is_empty());
        println!("{first} {later}");
        return;
    }
    let start = Instant::now();
    let count = if streamed {
        let sums = dir.usage_totals(&[f64::MIN]).expect("totals");
        sums.windows[0]
            .by_user
            .values()
            .map(|t| t.reservations)
            .sum()
    } else {
        dir.usage().expect("usage").records.len()
    };
    let ms = start.elapsed().as_secs_f64() * 1e3;
    assert!(count > 0);
    // SAFETY: getrusage with a valid struct to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    println!("{ms} {}", usage.ru_maxrss);
}

/// `usage`, `metrics` and the page's reading of a year of history: summed as a stream
/// from the logs' summaries of totals (written as `summarize_own_usage` writes them),
/// beside every record kept, each in a process of its own for its peak memory.
fn usage_totals(year: &LockDir) {
    let measure = |mode: &str| -> (f64, f64) {
        let v = child_numbers(mode, year, &[], 2);
        (v[0], v[1])
    };
    let (t_ms, t_kib) = measure("--totals");
    let (r_ms, r_kib) = measure("--records");
    let (t_mib, r_mib) = (t_kib / 1024.0, r_kib / 1024.0);
    let (w_first, w_later) = measure("--watch");
    println!(
        "  usage, metrics and the page over a year ({YEAR_RECORDS} records): summed as read \
         {t_ms:.0} ms, {t_mib:.0} MiB; every record kept {r_ms:.0} ms, {r_mib:.0} MiB"
    );
    println!("row|usage totals over a year of history, peak memory (MiB)|{t_mib:.0}|every record kept|{r_mib:.0}|MiB|lower");
    println!(
        "row|usage totals over a year of history, peak memory (MiB)|{t_mib:.0}|goal|64|MiB|lower"
    );
    println!("row|usage totals over a year of history (ms)|{t_ms:.0}|every record kept|{r_ms:.0}|ms|lower");
    println!("row|usage totals over a year of history (ms)|{t_ms:.0}|goal|50|ms|lower");
    println!(
        "row|serve's first usage reading, a year of history (ms)|{w_first:.0}|goal|50|ms|lower"
    );
    println!(
        "  serve's usage reading over the year: first {w_first:.0} ms, each later one (what was \
         appended) {w_later:.2} ms"
    );
    println!("row|serve's later usage reading, a year of history (ms)|{w_later:.2}|its first reading|{w_first:.0}|ms|lower");
}

fn main() {
    let tmp = tempfile::tempdir().expect("tempdir");
    if std::env::args().any(|a| a == "--decide") {
        decide();
        return;
    }
    for (flag, streamed) in [("--totals", true), ("--records", false), ("--watch", true)] {
        if std::env::args().any(|a| a == flag) {
            read_usage(streamed);
            return;
        }
    }
    if std::env::args().any(|a| a == "--waiter") {
        let dir = LockDir::open(std::env::var("TT_LOCK_BENCH_DIR").expect("dir")).expect("dir");
        waiter(&dir);
        return;
    }
    // The tallies this process keeps for its user (its decisions, and the writing of
    // logs, which summarizes as requests do) go to a cache of its own: not the bench
    // user's home, nor the one the deciding processes of `history_decision` are given.
    std::env::set_var("XDG_CACHE_HOME", tmp.path().join("bench-cache"));
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
    queue_decision(tmp.path());
    history_decision(tmp.path());
}
