//! Test support for the torchtools workspace (dev-dependency only, not published): the
//! reference Python, and test binaries that re-run themselves as child processes.
#![allow(clippy::unwrap_used, clippy::panic)] // a panic is how a test reports

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
    let out = python()
        .args(["-W", "ignore", "-c", script])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", python_path()));
    assert!(
        out.status.success(),
        "python failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// This test binary as a child process running only `test` (`--exact`, one thread,
/// output not captured): how a test gets a real second process. Set the child's
/// role through an environment variable the test reads.
pub fn rerun(test: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--test-threads=1", "--nocapture"]);
    cmd
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
