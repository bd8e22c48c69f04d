//! Detached runs as users run them: `--detach`, `jobs`, `logs -f`, `stop`, a terminal
//! that goes away, and jobs of another user.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

mod common;
use common::{torchtools, until};

/// `torchtools` with `dir/locks` as its lock directory and `dir/state` as the user's
/// state directory (where logs go).
fn tt(dir: &Path) -> Command {
    let mut c = torchtools(&dir.join("locks"));
    c.env("XDG_STATE_HOME", dir.join("state"));
    c
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Starts a detached job, returns its id (the one line it prints).
fn detach(dir: &Path, args: &[&str]) -> String {
    ok(tt(dir).args(args).output().unwrap()).trim().to_owned()
}

fn job(dir: &Path, id: &str) -> serde_json::Value {
    let all: serde_json::Value = serde_json::from_str(&ok(tt(dir)
        .args(["jobs", "--json", "--all"])
        .output()
        .unwrap()))
    .unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no job {id} in {all}"))
}

#[test]
fn a_detached_job_runs_on_its_own_and_is_found_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let id = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            "echo hello; sleep 1; echo bye",
        ],
    );
    // It runs (or starts) while `jobs` looks, and `logs -f` ends when it ends, with
    // every line.
    let state = job(dir, &id)["state"].as_str().unwrap().to_owned();
    assert!(
        ["starting", "running", "finished"].contains(&state.as_str()),
        "{state}"
    );
    let log = ok(tt(dir).args(["logs", &id, "-f"]).output().unwrap());
    assert!(log.contains("hello\n") && log.contains("bye\n"), "{log}");
    let done = job(dir, &id);
    assert_eq!(done["status"], 0, "{done}");
    assert_eq!(done["state"], "finished", "{done}");
    // `last` names it too.
    assert_eq!(ok(tt(dir).args(["logs", "last"]).output().unwrap()), log);

    // A detached launch keeps the ranks' prefixes in its log.
    let id = detach(
        dir,
        &[
            "launch",
            "--detach",
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo rank $RANK",
        ],
    );
    let log = ok(tt(dir).args(["logs", &id, "--follow"]).output().unwrap());
    assert!(
        log.contains("[rank0]: rank 0") && log.contains("[rank1]: rank 1"),
        "{log}"
    );
}

/// `stop`: SIGTERM reaches the command through torchtools; one that checkpoints and
/// exits 75 (as the trainer does) is recorded so.
#[test]
fn stop_sends_sigterm_and_the_status_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let id = detach(
        dir,
        &[
            "reserve", "--detach", "--gpu", "0", "--no-fence", "--", "sh", "-c",
            "trap 'echo checkpoint written; exit 75' TERM; echo ready; while true; do sleep 0.1; done",
        ],
    );
    until("the job is ready", || {
        ok(tt(dir).args(["logs", &id]).output().unwrap()).contains("ready")
    });
    let out = tt(dir).args(["stop", &id]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let done = job(dir, &id);
    assert_eq!(done["status"], 75, "{done}");
    assert!(ok(tt(dir).args(["logs", &id]).output().unwrap()).contains("checkpoint written"));
    // Stopping it again: it has ended, nothing to do.
    assert!(tt(dir)
        .args(["stop", &id])
        .output()
        .unwrap()
        .status
        .success());
}

/// The terminal that started a job goes away (its session gets SIGHUP, then is
/// killed): the job, in a session of its own, runs to its end.
#[test]
fn a_job_outlives_the_terminal_that_started_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let id_file = dir.join("id");
    let script = format!(
        "{} reserve --detach --gpu 0 --no-fence -- sh -c 'echo started; sleep 2; echo finished' > {}; sleep 600",
        env!("CARGO_BIN_EXE_torchtools"),
        id_file.display()
    );
    let mut terminal = Command::new("sh");
    terminal
        .args(["-c", &script])
        .env("TORCHTOOLS_LOCK_DIR", dir.join("locks"))
        .env("XDG_STATE_HOME", dir.join("state"))
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid is async-signal-safe: the "terminal"'s own session.
    unsafe {
        terminal.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut terminal = terminal.spawn().unwrap();
    until("the job's id", || {
        std::fs::read_to_string(&id_file).is_ok_and(|s| !s.trim().is_empty())
    });
    let id = std::fs::read_to_string(&id_file).unwrap().trim().to_owned();
    until("the job started", || {
        ok(tt(dir).args(["logs", &id]).output().unwrap()).contains("started")
    });
    let session = terminal.id() as i32;
    // SAFETY: kill(2) of the test's own child session group.
    unsafe {
        libc::kill(-session, libc::SIGHUP);
        libc::kill(-session, libc::SIGKILL);
    }
    terminal.wait().unwrap();
    let log = ok(tt(dir).args(["logs", &id, "-f"]).output().unwrap());
    assert!(log.contains("finished"), "{log}");
    assert_eq!(job(dir, &id)["status"], 0);
}

/// Bad input: said, non-zero, nothing started.
#[test]
fn bad_job_requests_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = tt(dir).args(["logs", "no-such-job"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no job"),
        "{out:?}"
    );
    let out = tt(dir)
        .args([
            "reserve",
            "--detach",
            "--log-dir",
            "/proc/no/such",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--log-dir"),
        "{out:?}"
    );
    let jobs = ok(tt(dir).args(["jobs"]).output().unwrap());
    assert!(jobs.starts_with("no job"), "nothing was started: {jobs}");
    // --log-dir without --detach.
    let out = tt(dir)
        .args([
            "reserve",
            "--log-dir",
            "/tmp",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
