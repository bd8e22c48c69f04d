//! Running commands as named steps, echoing their output and counting test results.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Selects the CLI's tests beside its programs, so the programs are built with its
/// tests' features (what the CLI's test step already built): for the invariant's CLI
/// and the test wheel's (the facade's tests pass `--tests` too).
pub(crate) const CLI_TEST_FEATURES: [&str; 2] = ["--bins", "--tests"];

/// `cargo ARGS` in the workspace root.
pub(crate) fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(args).current_dir(crate::root());
    cmd
}

/// Runs `cmd`, streaming its output; fails when it fails.
pub(crate) fn run(name: &str, mut cmd: Command) -> Result<()> {
    eprintln!("==> {name}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {cmd:?}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

/// Test counts read from libtest's `test result:` lines.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counts {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) ignored: u64,
    /// Tests that returned at once after a `SKIPPED: ` line (`tt_testkit::skip_knowingly`):
    /// libtest counts them as passed; here they are taken out of `passed`.
    pub(crate) not_run: u64,
}

impl Counts {
    pub(crate) fn add(&mut self, other: Counts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
        self.not_run += other.not_run;
    }

    /// Parses `test result: ok. 4 passed; 0 failed; 1 ignored; ...`.
    fn parse_line(line: &str) -> Option<Counts> {
        let rest = line.trim().strip_prefix("test result: ")?;
        let mut counts = Counts::default();
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let n = words
                .iter()
                .rev()
                .nth(1)
                .and_then(|w| w.parse::<u64>().ok());
            match (n, words.last()) {
                (Some(n), Some(&"passed")) => counts.passed = n,
                (Some(n), Some(&"failed")) => counts.failed = n,
                (Some(n), Some(&"ignored")) => counts.ignored = n,
                _ => {}
            }
        }
        Some(counts)
    }
}

/// Outcome of one step of a matrix.
pub(crate) struct StepResult {
    pub(crate) name: String,
    pub(crate) ok: bool,
    pub(crate) time: Duration,
    pub(crate) counts: Option<Counts>,
    /// Per test binary (see [`binary_of`]), its counts, in the order they ran.
    pub(crate) binaries: Vec<(String, Counts)>,
    /// The `SKIPPED: ` lines, each with its test binary: tests that did not run here.
    pub(crate) skipped: Vec<String>,
}

/// The test binary a line of cargo's output starts: `Running unittests src/lib.rs
/// (target/debug/deps/tt_lock-0a1b)` is `tt_lock src/lib.rs`, `Running tests/share.rs
/// (target/debug/deps/share-0a1b)` is `tests/share.rs`, `Doc-tests tt_lock` is
/// `tt_lock doc-tests`.
pub(crate) fn binary_of(line: &str) -> Option<String> {
    let line = line.trim();
    if let Some(krate) = line.strip_prefix("Doc-tests ") {
        return Some(format!("{} doc-tests", krate.trim()));
    }
    let rest = line.strip_prefix("Running ")?;
    let (what, exe) = rest.rsplit_once(" (")?;
    match what.strip_prefix("unittests ") {
        Some(src) => {
            let stem = exe.trim_end_matches(')').rsplit('/').next()?;
            let krate = stem.rsplit_once('-').map_or(stem, |(k, _)| k);
            Some(format!("{krate} {src}"))
        }
        None => Some(what.to_owned()),
    }
}

/// Runs `work` in this process as a step of a matrix: its error is printed and the
/// step marked failed.
pub(crate) fn in_process(name: &str, work: impl FnOnce() -> Result<()>) -> StepResult {
    eprintln!("\n==> {name}");
    let start = Instant::now();
    let ok = match work() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            false
        }
    };
    StepResult {
        name: name.to_owned(),
        ok,
        time: start.elapsed(),
        counts: None,
        binaries: Vec::new(),
        skipped: Vec::new(),
    }
}

/// The longest one step may run (the longest, the workspace's tests with its build,
/// took under 3 minutes in a fresh-clone run on 2 cores, 2026-11-24). A step still running then hangs: it is
/// reported (where each of its processes waits) and killed, so that the matrix ends
/// with a failure naming the hang instead of running into CI's own limit.
const STEP_LIMIT: Duration = Duration::from_secs(30 * 60);

/// Kills `pid`'s process tree after `limit` unless told to stand down first, printing
/// where each process of it waits.
fn watchdog(name: &str, pid: u32, limit: Duration) -> std::sync::mpsc::Sender<()> {
    let (done, stand_down) = std::sync::mpsc::channel::<()>();
    let name = name.to_owned();
    std::thread::spawn(move || {
        if stand_down.recv_timeout(limit) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
            return;
        }
        eprintln!(
            "\n{name}: still running after {limit:?}, so it hangs; where its processes wait:\n{}",
            tt_testkit::hang::report(pid)
        );
        kill_tree(pid);
        eprintln!("{name}: killed");
    });
    done
}

/// SIGKILL to `pid` and every process below it (listed first, so none is missed by
/// being reparented on the way).
fn kill_tree(pid: u32) {
    let mut all = vec![pid];
    let mut i = 0;
    while i < all.len() {
        all.extend(tt_testkit::hang::children(all[i]));
        i += 1;
    }
    for p in all {
        if let Ok(p) = libc::pid_t::try_from(p) {
            // SAFETY: kill has no memory preconditions; these pids are ours.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}

/// After the step's process exits, how long its output may stay silent before the
/// step stops reading: a process it left behind (a detached job's keeper) may hold
/// the pipe open for as long as it lives.
const DRAIN_IDLE: Duration = Duration::from_secs(5);

/// Runs `cmd` as a step, echoing its output (stdout and stderr, in the order written:
/// one pipe) while counting test results in it, per test binary too.
pub(crate) fn run_counted(name: &str, mut cmd: Command) -> StepResult {
    eprintln!("\n==> {name}");
    let start = Instant::now();
    let mut counts = Counts::default();
    let mut saw_tests = false;
    let mut binaries: Vec<(String, Counts)> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    // Close-on-exec here; the child gets the writing end as its descriptors 1 and 2.
    let spawned = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(std::io::Error::from)
        .and_then(|(reader, writer)| {
            cmd.stdout(Stdio::from(writer.try_clone()?))
                .stderr(Stdio::from(writer));
            let child = cmd.spawn()?;
            Ok((child, std::fs::File::from(reader)))
        });
    // The command holds the pipe's writing ends: without them, the read ends when the
    // step's processes are gone.
    drop(cmd);
    let ok = match spawned {
        Ok((mut child, out)) => {
            let _watchdog = watchdog(name, child.id(), STEP_LIMIT);
            let (tx, lines) = std::sync::mpsc::channel::<String>();
            std::thread::spawn(move || {
                // Lossy: a test printing bytes that are not UTF-8 must not hide the
                // counts of the lines after it.
                let mut reader = BufReader::new(out);
                let mut raw = Vec::new();
                while reader.read_until(b'\n', &mut raw).is_ok_and(|n| n > 0) {
                    let line = String::from_utf8_lossy(&raw);
                    if tx
                        .send(line.trim_end_matches(['\n', '\r']).to_owned())
                        .is_err()
                    {
                        return;
                    }
                    raw.clear();
                }
            });
            let mut current = String::from("?");
            let mut pending_skips = 0u64;
            let mut exited = None;
            loop {
                let wait = match exited {
                    None => Duration::from_millis(200),
                    Some(_) => DRAIN_IDLE,
                };
                match lines.recv_timeout(wait) {
                    Ok(line) => {
                        println!("{line}");
                        if let Some(binary) = binary_of(&line) {
                            current = binary;
                            pending_skips = 0;
                        } else if let Some((_, what)) = line.split_once("SKIPPED: ") {
                            skipped.push(format!("{current}: {what}"));
                            pending_skips += 1;
                        } else if let Some(mut c) = Counts::parse_line(&line) {
                            // The binary's skipped tests passed for libtest: not here.
                            c.not_run = pending_skips.min(c.passed);
                            c.passed -= c.not_run;
                            pending_skips = 0;
                            counts.add(c);
                            saw_tests = true;
                            match binaries.iter_mut().find(|(b, _)| *b == current) {
                                Some((_, sum)) => sum.add(c),
                                None => binaries.push((current.clone(), c)),
                            }
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if exited.is_some() => break,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                }
                if exited.is_none() {
                    exited = child.try_wait().ok().flatten();
                }
            }
            match exited {
                Some(status) => status.success(),
                None => child.wait().map(|s| s.success()).unwrap_or(false),
            }
        }
        Err(e) => {
            eprintln!("could not start the step's command: {e}");
            false
        }
    };
    StepResult {
        name: name.to_owned(),
        ok,
        time: start.elapsed(),
        counts: saw_tests.then_some(counts),
        binaries,
        skipped,
    }
}

/// Prints the table of a matrix and the closing `N passed, N failed` line.
pub(crate) fn summarize(title: &str, results: &[StepResult]) -> Counts {
    let mut total = Counts::default();
    println!("\n{title}");
    println!(
        "{:<58} {:>6} {:>8} {:>7}",
        "step", "result", "tests", "time"
    );
    for r in results {
        let tests = r
            .counts
            .map(|c| c.passed.to_string())
            .unwrap_or_else(|| "-".into());
        let result = if r.ok { "ok" } else { "FAILED" };
        println!(
            "{:<58} {:>6} {:>8} {:>6.1}s",
            r.name,
            result,
            tests,
            r.time.as_secs_f64()
        );
        if let Some(c) = r.counts {
            total.add(c);
        }
    }
    // Each test binary's passed tests (what `--record-minimums` records).
    for r in results {
        for (binary, c) in &r.binaries {
            println!("binary: {} | {binary} | {}", r.name, c.passed);
        }
    }
    let skipped: Vec<&String> = results.iter().flat_map(|r| &r.skipped).collect();
    if !skipped.is_empty() {
        println!("not run here (counted apart, never as passed):");
        for line in skipped {
            println!("  {line}");
        }
    }
    let failed_steps = results.iter().filter(|r| !r.ok).count() as u64;
    println!(
        "{title}: {} passed, {} failed, {} skipped ({} ignored, {} not run here)",
        total.passed,
        total.failed.max(failed_steps),
        total.ignored + total.not_run,
        total.ignored,
        total.not_run
    );
    total
}

#[cfg(test)]
mod tests {
    use super::{watchdog, Counts};
    use std::time::{Duration, Instant};

    #[test]
    fn a_hung_step_is_killed_with_its_children_and_a_finished_one_is_left_alone() {
        // A shell that waits on a child that sleeps for ever: the whole tree goes.
        let mut hung = std::process::Command::new("sh")
            .args(["-c", "sleep 3600 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(hung.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let sleeper: i32 = line.trim().parse().unwrap();
        let _dog = watchdog("hung", hung.id(), Duration::from_millis(300));
        let status = hung.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        // SAFETY: signal 0 only asks whether the process exists.
        while unsafe { libc::kill(sleeper, 0) } == 0 {
            assert!(Instant::now() < deadline, "the hung step's child lives on");
            std::thread::sleep(Duration::from_millis(10));
        }
        // A step that ends first stands the watchdog down: it kills nothing later.
        let mut other = std::process::Command::new("sleep")
            .arg("3600")
            .spawn()
            .unwrap();
        drop(watchdog("done", other.id(), Duration::from_millis(300)));
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            other.try_wait().unwrap().is_none(),
            "killed after standing down"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn each_binary_is_named_by_cargos_line() {
        use super::binary_of;
        assert_eq!(
            binary_of("     Running unittests src/lib.rs (target/debug/deps/tt_lock-0a1b2c3d)"),
            Some("tt_lock src/lib.rs".into())
        );
        assert_eq!(
            binary_of("     Running tests/share.rs (target/debug/deps/share-0a1b2c3d)"),
            Some("tests/share.rs".into())
        );
        assert_eq!(
            binary_of("   Doc-tests tt_lock"),
            Some("tt_lock doc-tests".into())
        );
        assert_eq!(binary_of("test result: ok. 1 passed"), None);
        assert_eq!(binary_of("Running the demo"), None);
    }

    /// Counts per binary from cargo's stderr lines and the binaries' stdout, through
    /// one pipe; a process left holding the pipe does not hold the step.
    #[test]
    fn a_step_counts_per_binary_and_ends_though_a_child_holds_its_output() {
        let script = "echo '     Running tests/a.rs (target/debug/deps/a-1)' >&2; \
                      echo 'test result: ok. 3 passed; 0 failed; 1 ignored'; \
                      echo '   Doc-tests k' >&2; \
                      echo 'test result: ok. 2 passed; 0 failed; 0 ignored'; \
                      (sleep 60 &) ; exit 0";
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", script]);
        let start = Instant::now();
        let r = super::run_counted("fake", cmd);
        assert!(r.ok);
        assert!(
            start.elapsed() < Duration::from_secs(50),
            "{:?}",
            start.elapsed()
        );
        let got: Vec<(String, u64)> = r
            .binaries
            .iter()
            .map(|(b, c)| (b.clone(), c.passed))
            .collect();
        assert_eq!(
            got,
            [("tests/a.rs".to_owned(), 3), ("k doc-tests".to_owned(), 2)]
        );
        assert_eq!(r.counts.map(|c| (c.passed, c.ignored)), Some((5, 1)));
    }

    #[test]
    fn a_skipped_test_is_counted_apart_never_as_passed() {
        let script = "echo '     Running tests/a.rs (target/debug/deps/a-1)' >&2; \
                      echo 'SKIPPED: two_users: a second user needs root: no root' >&2; \
                      echo 'test result: ok. 3 passed; 0 failed; 1 ignored'; \
                      echo '     Running tests/b.rs (target/debug/deps/b-1)' >&2; \
                      echo 'test result: ok. 2 passed; 0 failed; 0 ignored'";
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", script]);
        let r = super::run_counted("fake", cmd);
        let got: Vec<(String, u64, u64)> = r
            .binaries
            .iter()
            .map(|(b, c)| (b.clone(), c.passed, c.not_run))
            .collect();
        assert_eq!(
            got,
            [
                ("tests/a.rs".to_owned(), 2, 1),
                ("tests/b.rs".to_owned(), 2, 0)
            ]
        );
        assert_eq!(
            r.skipped,
            ["tests/a.rs: two_users: a second user needs root: no root"]
        );
        let total = super::summarize("fake", &[r]);
        assert_eq!((total.passed, total.ignored, total.not_run), (4, 1, 1));
    }

    #[test]
    fn parses_libtest_summary_lines() {
        let c = Counts::parse_line(
            "test result: ok. 12 passed; 3 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.04s",
        )
        .unwrap();
        assert_eq!((c.passed, c.failed, c.ignored), (12, 3, 2));
        assert!(Counts::parse_line("running 4 tests").is_none());
    }
}
