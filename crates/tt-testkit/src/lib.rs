#![doc = include_str!("../README.md")]
#![allow(clippy::unwrap_used, clippy::panic)] // a panic is how a test reports

pub mod bench;
pub mod hang;
pub mod netns;
pub mod slurm;
pub mod users;

/// A TCP port free on loopback now (the kernel's pick).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

use std::io::{BufRead, BufReader, Read};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

/// The variable naming the reference Python (with torch 2.11).
pub const PYTHON_ENV: &str = "TORCHTOOLS_PYTHON";

/// The reference Python's path: `TORCHTOOLS_PYTHON` (set for cargo by `cargo xtask
/// setup`, and by the GPU bundle's `run.sh`). Panics, naming the fix, when it is unset:
/// a reference test fails, never skips and never falls back to another interpreter.
pub fn python_path() -> String {
    match std::env::var(PYTHON_ENV) {
        Ok(p) if !p.is_empty() => p,
        _ => panic!(
            "{PYTHON_ENV} is not set: run `cargo xtask setup` (it installs torch 2.11 and sets \
             it for cargo), or set it to a Python with torch 2.11"
        ),
    }
}

/// A command running the reference Python.
pub fn python() -> Command {
    Command::new(python_path())
}

/// Runs `script` (`python -W ignore -c script args..`) and returns its stdout; the
/// test fails with Python's stderr when it does.
pub fn run_python(script: &str, args: &[&str]) -> String {
    run_checked(&["-c", script], args)
}

/// Runs a module of the reference Python (`python -W ignore -m module args..`, e.g.
/// gpu_tracker's command line) and returns its stdout; the test fails with its stderr
/// when it does.
pub fn run_python_module(module: &str, args: &[&str]) -> String {
    run_checked(&["-m", module], args)
}

/// `python -W ignore WHAT.. ARGS..`, its stdout; fails the test when it fails.
fn run_checked(what: &[&str], args: &[&str]) -> String {
    let out = python()
        .args(["-W", "ignore"])
        .args(what)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", python_path()));
    assert!(
        out.status.success(),
        "python {what:?} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// This test binary as a child process running only `test` (`--exact`, one thread,
/// output not captured, ignored tests included): how a test gets a real second
/// process. Set the child's role through an environment variable the test reads, and
/// mark a test that is only a child's entry point `#[ignore = "..."]`, so that a
/// normal run reports it ignored instead of counting an empty pass.
///
/// A test binary made of modules (`tests/it/main.rs`) names its tests `module::test`:
/// an unqualified `test` is looked for in the module of the calling test (the child's
/// entry point sits beside the test that runs it).
pub fn rerun(test: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(rerun_args(test));
    cmd
}

/// [`rerun`]'s arguments, for a child of this test binary started another way: through
/// a copy another user may run, or under a wrapper such as `taskset`.
pub fn rerun_args(test: &str) -> [String; 5] {
    [
        "--exact".into(),
        in_callers_module(test),
        "--include-ignored".into(),
        "--test-threads=1".into(),
        "--nocapture".into(),
    ]
}

/// `test` in the module of the test running on this thread (libtest names each test's
/// thread after its path): `a::child` when called from `a::parent`; as given when it
/// is qualified already or the caller is not in a module.
fn in_callers_module(test: &str) -> String {
    if test.contains("::") {
        return test.to_owned();
    }
    let thread = std::thread::current();
    match thread.name().and_then(|name| name.rsplit_once("::")) {
        Some((module, _)) => format!("{module}::{test}"),
        None => test.to_owned(),
    }
}

/// Reads `from` (a child's stdout or stderr) line by line until a line contains
/// `marker`, and returns that line. Fails the test when the stream ends first or
/// `limit` passes (a generous upper bound: tests wait for events, not for time).
/// The reader moves to a thread, which drains the rest of the stream after the
/// marker so the child never blocks on a full pipe.
pub fn wait_for_line(from: impl Read + Send + 'static, marker: &str, limit: Duration) -> String {
    let (tx, rx) = mpsc::channel();
    let wanted = marker.to_owned();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if !sent && line.contains(&wanted) {
                let _ = tx.send(Ok(line));
                sent = true;
            } else if !sent {
                let _ = tx.send(Err(line));
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(line)) => return line,
            Ok(Err(other)) => seen.push(other),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("no line with {marker:?} within {limit:?}; the child said: {seen:?}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                panic!("the child's output ended before {marker:?}; it said: {seen:?}")
            }
        }
    }
}

/// A test body of a custom-harness binary: `Err` = failed, with why.
pub type TestFn = fn() -> Result<(), String>;

/// Which tests a custom-harness binary runs, by libtest's own argument rules: names
/// containing any positional filter (all when none), `--exact` for whole names,
/// `--skip PATTERN` (repeatable) to leave some out, `--list` to print them; libtest's
/// other flags (`--nocapture`, `--test-threads N`, ...) are accepted and ignored.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Positional filters.
    pub filters: Vec<String>,
    /// Patterns to leave out.
    pub skip: Vec<String>,
    /// Filters match whole names.
    pub exact: bool,
    /// Print the names instead of running.
    pub list: bool,
}

impl Selection {
    /// From arguments, as libtest reads them (without the program name).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Selection {
        /// libtest's flags that take a value as the next argument.
        const WITH_VALUE: [&str; 6] = [
            "--skip",
            "--test-threads",
            "--format",
            "--color",
            "--logfile",
            "--shuffle-seed",
        ];
        let mut sel = Selection::default();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--exact" => sel.exact = true,
                "--list" => sel.list = true,
                "--skip" => sel.skip.extend(args.next()),
                a if a.starts_with("--skip=") => sel.skip.push(a["--skip=".len()..].to_owned()),
                a if WITH_VALUE.contains(&a) => {
                    args.next();
                }
                a if a.starts_with('-') => {}
                _ => sel.filters.push(arg),
            }
        }
        sel
    }

    /// Whether the test `name` runs.
    pub fn runs(&self, name: &str) -> bool {
        let matches = |f: &String| {
            if self.exact {
                name == f
            } else {
                name.contains(f.as_str())
            }
        };
        (self.filters.is_empty() || self.filters.iter().any(matches))
            && !self.skip.iter().any(|s| name.contains(s.as_str()))
    }
}

/// Reports the calling GPU test as not run on this machine, with `why` (two GPUs
/// needed on a one-GPU machine, MIG without a MIG device): prints
/// `@@not-run TEST: WHY`, which the GPU bundle's `run.sh` counts apart, never as
/// passed. The test returns right after. `TEST` is the test's thread name (libtest
/// names each test's thread after it).
pub fn not_run(why: &str) {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("test");
    println!("@@not-run {name}: {why}");
}

/// A test that cannot run on this machine (it `needs` root, a namespace, ...): where
/// `TORCHTOOLS_TEST_NO_MOUNT=<why>` says why, prints `SKIPPED: TEST: NEEDS: WHY` and
/// returns, for the test to return at once; otherwise fails the test with `failure`
/// (which should say how to run it, or how to skip it knowingly). The line is written
/// past libtest's capture, so that `cargo xtask test` sees it whether the test passes or
/// not: it lists each one and counts it apart, never as passed.
///
/// Run as root, a test has what these tests need: a skip there means its set-up failed
/// (a leftover interface, a missing `ip`), and fails the test whatever the variable
/// says, unless the test is one of [`ROOT_MAY_SKIP`].
pub fn skip_knowingly(needs: &str, failure: &str) {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("test");
    if is_root() && !ROOT_MAY_SKIP.iter().any(|(test, _)| *test == name) {
        panic!("{failure} (run as root, where nothing may skip: the set-up failed)");
    }
    match std::env::var(NO_MOUNT_ENV) {
        Ok(why) if !why.trim().is_empty() => {
            let line = format!("SKIPPED: {name}: {needs}: {}\n", why.trim());
            // One write: the line stays whole beside the other tests' output.
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
        _ => panic!("{failure}"),
    }
}

/// The tests that may skip knowingly even when run as root (by their name in their test
/// binary), each with its reason: the one list of them.
pub const ROOT_MAY_SKIP: [(&str, &str); 1] = [(
    "tests::skipping_child",
    "tt-testkit's own test of a knowing skip, which CI runs as root",
)];

/// Whether this process runs as root (effective user 0), from `/proc/self/status`.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Runs the selected `tests` (see [`Selection`]) one after the other, printing libtest's
/// lines (`test NAME ... ok`, `test result: ok. N passed; M failed`), and exits
/// non-zero when one failed.
pub fn run_tests(tests: &[(&str, TestFn)]) {
    let sel = Selection::parse(std::env::args().skip(1));
    let chosen: Vec<&(&str, TestFn)> = tests.iter().filter(|(name, _)| sel.runs(name)).collect();
    if sel.list {
        for (name, _) in &chosen {
            println!("{name}: test");
        }
        return;
    }
    println!("\nrunning {} tests", chosen.len());
    let mut failed = Vec::new();
    for (name, test) in &chosen {
        let start = std::time::Instant::now();
        let result = test();
        let secs = start.elapsed().as_secs_f64();
        match result {
            Ok(()) => println!("test {name} ... ok ({secs:.1}s)"),
            Err(e) => {
                println!("test {name} ... FAILED ({secs:.1}s)\n  {e}");
                failed.push(*name);
            }
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed; 0 ignored; 0 measured; {} filtered out",
        if failed.is_empty() { "ok" } else { "FAILED" },
        chosen.len() - failed.len(),
        failed.len(),
        tests.len() - chosen.len()
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
}

/// Checks a [`rerun`] child's output: it succeeded and ran exactly one test (a renamed
/// or filtered-out child test would run none and still exit 0).
pub fn assert_ran_one(out: &std::process::Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "the child test did not run exactly one test ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The variable that lets a test which needs a mount (root) skip, visibly, with the
/// reason it holds.
pub const NO_MOUNT_ENV: &str = "TORCHTOOLS_TEST_NO_MOUNT";

/// A filesystem mounted for a test, unmounted on drop.
#[must_use = "the mount is undone when this is dropped"]
pub struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Runs `mount ARGS AT`. Mounting needs root (CI runs as root); where it fails, the test
/// fails unless `TORCHTOOLS_TEST_NO_MOUNT=<why>` says why it cannot run, and then
/// `None` comes back after a "SKIPPED: {needs}: {why}" line: a skip someone chose,
/// printed, never a silent one.
pub fn mount_or_skip(needs: &str, args: &[&str], at: &std::path::Path) -> Option<Mounted> {
    let mounted = Command::new("mount")
        .args(args)
        .arg(at)
        .status()
        .is_ok_and(|s| s.success());
    if mounted {
        return Some(Mounted(at.to_path_buf()));
    }
    skip_knowingly(
        needs,
        &format!(
            "{needs}, and `mount {}` failed (mounting needs root): run as root, or set \
             {NO_MOUNT_ENV}=<why> to skip this test knowingly",
            args.join(" ")
        ),
    );
    None
}

#[cfg(test)]
mod tests {
    use super::Selection;

    #[test]
    #[ignore = "a child's entry point, run by the skip test"]
    fn skipping_child() {
        super::skip_knowingly(
            "a thing this machine lacks",
            "not skipped: the variable is unset",
        );
    }

    #[test]
    #[ignore = "a child's entry point, run by the skip test"]
    fn skipping_child_not_allowed_as_root() {
        super::skip_knowingly("a thing this machine lacks", "not skipped");
    }

    /// As root, a test not on the list fails even with the variable set: its set-up
    /// failed, since root has what the skipping tests need. (Not as root, it skips.)
    #[test]
    fn as_root_only_the_listed_tests_may_skip() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::skipping_child_not_allowed_as_root",
                "--include-ignored",
            ])
            .env(super::NO_MOUNT_ENV, "no root in this container")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        if super::is_root() {
            assert!(!out.status.success(), "{stdout}");
            assert!(stdout.contains("nothing may skip"), "{stdout}");
        } else {
            assert!(out.status.success(), "{stdout}");
        }
    }

    /// The skip line shows through libtest's capture (a passing test's output is
    /// captured), so that `cargo xtask test` sees and counts it; without the variable,
    /// the test fails instead.
    #[test]
    fn a_knowing_skip_is_printed_past_the_capture_and_an_unknowing_one_fails() {
        let child = |why: Option<&str>| {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", "tests::skipping_child", "--include-ignored"]);
            match why {
                Some(w) => cmd.env(super::NO_MOUNT_ENV, w),
                None => cmd.env_remove(super::NO_MOUNT_ENV),
            };
            cmd.output().unwrap()
        };
        let out = child(Some("no root in this container"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains(
                "SKIPPED: tests::skipping_child: a thing this machine lacks: no root in this container\n"
            ),
            "{stderr}"
        );
        let out = child(None);
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("not skipped: the variable is unset"));
    }

    #[test]
    fn a_child_is_looked_for_in_the_module_of_the_test_that_runs_it() {
        // This test's thread is `tests::a_child_is_...`: its children are `tests::...`.
        assert_eq!(super::in_callers_module("child"), "tests::child");
        assert_eq!(super::in_callers_module("other::child"), "other::child");
        let unnamed = std::thread::spawn(|| super::in_callers_module("child"));
        assert_eq!(unnamed.join().unwrap(), "child");
    }

    fn sel(args: &[&str]) -> Selection {
        Selection::parse(args.iter().map(|a| (*a).to_owned()))
    }

    #[test]
    fn libtests_argument_rules() {
        let all = sel(&["--nocapture", "--test-threads", "1"]);
        assert!(all.runs("a") && all.runs("b"), "{all:?}");
        // --skip takes the next argument as a pattern to leave out, not a filter.
        let s = sel(&["--skip", "slow"]);
        assert!(s.runs("fast_one") && !s.runs("slow_one"), "{s:?}");
        let s = sel(&["--skip=slow", "one"]);
        assert!(s.runs("fast_one") && !s.runs("slow_one") && !s.runs("two"));
        let s = sel(&["one", "--exact"]);
        assert!(s.runs("one") && !s.runs("one_more"));
        assert!(sel(&["--list"]).list);
    }
}
