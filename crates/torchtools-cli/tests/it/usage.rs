//! `torchtools usage`: the usage log every reservation writes, read back as GPU-hours,
//! with real reservations, a `kill -9` in the middle and a damaged record.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::torchtools;

fn usage(dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = torchtools(dir)
        .args(["usage", "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Reservations of known lengths on GPUs 0 and 1, one ending with status 3, and one
/// killed with `kill -9` (the command and `torchtools` together) while it holds GPU 2:
/// the hours are theirs, the exit status is recorded, and the killed one is shown lost
/// by every reader, ending between its death and that read, without a word written.
#[test]
fn reservations_are_counted_and_a_killed_holder_is_closed_by_the_next_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let reserve = |gpu: &str, script: &str| {
        torchtools(dir)
            .args([
                "reserve",
                "--gpu",
                gpu,
                "--bytes",
                "2GiB",
                "--no-fence",
                "--",
            ])
            .args(["sh", "-c", script])
            .output()
            .unwrap()
    };
    // Each reservation lasts at least its sleep and at most its `reserve`'s whole run,
    // measured here: exact bounds, whatever the machine's load.
    let (mut sleeps, mut walls, mut gpu0_walls) = (0.0, 0.0, 0.0);
    for (gpu, seconds) in [("0", 1.0), ("1", 0.5), ("0", 0.5)] {
        let started = std::time::Instant::now();
        let out = reserve(gpu, &format!("sleep {seconds}"));
        let wall = started.elapsed().as_secs_f64();
        assert!(out.status.success(), "{out:?}");
        sleeps += seconds;
        walls += wall;
        if gpu == "0" {
            gpu0_walls += wall;
        }
    }
    let started = std::time::Instant::now();
    let out = reserve("1", "exit 3");
    walls += started.elapsed().as_secs_f64();
    assert_eq!(out.status.code(), Some(3));

    // GPU 2, killed while held: `torchtools` and its command in their own group.
    let mut held = torchtools(dir)
        .args(["reserve", "--gpu", "2", "--no-fence", "--"])
        .args(["sh", "-c", "echo ready; exec sleep 600"])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(held.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let running = usage(dir, &["--by", "gpu"]);
    let gpu2 = running["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "2");
    assert_eq!(gpu2.unwrap()["running"], 1, "{running}");
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = now();
    // SAFETY: kill(2) of the process group of a child of this test.
    unsafe { libc::kill(-(held.id() as i32), libc::SIGKILL) };
    held.wait().unwrap();
    let before_read = now();
    let after = usage(dir, &["--by", "gpu"]);
    let rows = after["rows"].as_array().unwrap();
    let row = |name: &str| rows.iter().find(|r| r["name"] == name).unwrap();
    assert_eq!(row("2")["running"], 0, "{after}");
    assert_eq!(row("2")["lost"], 1, "{after}");
    let lost_hours = row("2")["gpu_hours"].as_f64().unwrap();
    assert!(lost_hours * 3600.0 >= 0.3, "{after}");
    // Lost, computed at the read and ended no later than it: nothing is written into
    // anyone's log for it, so a second read finds it lost again, once.
    let log_path = || {
        // SAFETY: geteuid has no preconditions.
        tt_lock::LockDir::open(dir)
            .unwrap()
            .usage_log_path(unsafe { libc::geteuid() })
    };
    let read = || tt_lock::LockDir::open(dir).unwrap().usage().unwrap();
    let lost: Vec<_> = read().records.into_iter().filter(|r| r.lost).collect();
    assert_eq!(lost.len(), 1, "{lost:?}");
    let end = lost[0].ended_unix.unwrap();
    assert!(
        end >= killed_at - 1.0 && end <= now(),
        "{end} vs killed at {killed_at}, read at {before_read}"
    );
    assert_eq!(read().records.iter().filter(|r| r.lost).count(), 1);
    let log = std::fs::read_to_string(log_path()).unwrap();
    assert!(!log.contains("\"lost\":true"), "{log}");

    // The finished ones: at least their sleeps, at most their `reserve`s' runs.
    let finished: f64 = ["0", "1"]
        .iter()
        .map(|g| row(g)["gpu_hours"].as_f64().unwrap())
        .sum();
    let seconds = finished * 3600.0;
    assert!(
        seconds >= sleeps && seconds <= walls,
        "{seconds} s for {sleeps} s of sleeps in {walls} s of reserve runs"
    );
    // GPU 0: 2 GiB for its two reservations (1.5 s of sleeps).
    let gib_seconds = row("0")["reserved_gib_hours"].as_f64().unwrap() * 3600.0;
    assert!(
        gib_seconds >= 2.0 * 1.5 && gib_seconds <= 2.0 * gpu0_walls,
        "{gib_seconds} GiB-s for 2 GiB over 1.5 s of sleeps in {gpu0_walls} s: {after}"
    );
    assert!(log.contains("\"status\":3"), "{log}");

    // A damaged record (a full disk cut it short): skipped, said, never an error; it
    // costs that line only, not the next reservation's record.
    std::fs::OpenOptions::new()
        .append(true)
        .open(log_path())
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"event\":\"sta"))
        .unwrap();
    let before = read().records.len();
    let out = reserve("3", "exit 0");
    assert!(out.status.success(), "{out:?}");
    let after_damage = read();
    assert_eq!(after_damage.records.len(), before + 1, "{after_damage:?}");
    assert_eq!(after_damage.skipped.len(), 1, "{after_damage:?}");
    let out = torchtools(dir).args(["usage"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 damaged line(s) skipped"),
        "{out:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("reservations"),
        "{out:?}"
    );
    // --since: only what ran in the last while.
    let started = Instant::now();
    let recent = usage(dir, &["--since", "1h"]);
    assert!(!recent["rows"].as_array().unwrap().is_empty(), "{recent}");
    assert!(started.elapsed() < crate::common::PATIENCE);
}

/// Two Unix users (this test's, root in CI, and `nobody` through `runuser`) share one
/// log: each appends to it, and `usage --by user` counts both.
#[test]
fn two_users_share_the_usage_log() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path().join("locks");
    let reserve = |as_nobody: bool, gpu: &str| {
        let mut cmd = if as_nobody {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "nobody", "--", env!("CARGO_BIN_EXE_torchtools")])
                .env("TORCHTOOLS_LOCK_DIR", &dir)
                .env_remove("CUDA_VISIBLE_DEVICES")
                .env_remove("TORCHTOOLS_HELD_LOCKS")
                .stdin(Stdio::null());
            c
        } else {
            torchtools(&dir)
        };
        let out = cmd
            .args(["reserve", "--gpu", gpu, "--no-fence", "--", "sleep", "0.2"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    reserve(false, "0"); // creates the log
    reserve(true, "1"); // another user appends to it
    let rows = usage(&dir, &["--by", "user"]);
    let users: Vec<&str> = rows["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(users.contains(&"nobody") && users.len() == 2, "{rows}");
}
