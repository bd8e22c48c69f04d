//! `torchtools launch` with real processes.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("launch")
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .unwrap()
}

#[test]
fn every_rank_gets_torchruns_variables_and_a_prefix() {
    let out = launch(&[
        "--nproc-per-node", "3", "--", "sh", "-c",
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{text}");
    let port = lines[0].split(' ').nth(6).unwrap().to_owned();
    assert!(port.parse::<u16>().is_ok(), "{text}");
    for (rank, line) in lines.iter().enumerate() {
        assert_eq!(
            *line,
            format!("[rank{rank}]: {rank} 3 {rank} 3 127.0.0.1 {port} 1")
        );
    }
}

#[test]
fn a_failed_rank_stops_the_others_and_is_named() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then sleep 0.2; exit 3; else exec sleep 30; fi",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 exited with status 3"), "{err}");
}

#[test]
fn the_group_is_restarted_up_to_max_restarts() {
    let script =
        "if [ $TORCHELASTIC_RESTART_COUNT -lt 1 ] && [ $RANK = 0 ]; then exit 5; fi; echo ok";
    let out = launch(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("restarting the group (1/1)"));
    let out = launch(&["--nproc-per-node", "2", "--", "sh", "-c", "exit 5"]);
    assert_eq!(out.status.code(), Some(5));
    let out = launch(&["--nnodes", "2", "--node-rank", "2", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank 2"));
}

#[test]
fn omp_num_threads_is_set_to_1_only_when_unset() {
    // Unset (above): 1 per rank, as torchrun does. Set by the user: theirs, untouched.
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo omp=$OMP_NUM_THREADS",
        ])
        .env("OMP_NUM_THREADS", "3")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.matches("omp=3").count(), 2, "{text}");
}

/// A Python rank's `print`, without flush, shows while the rank runs, as it does under
/// torchrun (whose ranks write to the terminal): ours write into a pipe, where Python
/// would hold the line back until it exits. The rank waits for a file that the test
/// creates only once it has seen the line. PYTHONUNBUFFERED is unset, as on most users'
/// machines.
#[test]
fn a_python_ranks_print_shows_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = "import os, sys, time\n\
                  print('step 1 done')\n\
                  t = time.time()\n\
                  while not os.path.exists(sys.argv[1]) and time.time() - t < 300:\n\
                  \x20   time.sleep(0.05)\n\
                  print('finished')\n";
    let mut child = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("launch")
        .args(["--nproc-per-node", "1", "--"])
        .arg(tt_testkit::python_path())
        .args(["-c", script])
        .arg(&go)
        .env_remove("PYTHONUNBUFFERED")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let line = tt_testkit::wait_for_line(
        child.stdout.take().unwrap(),
        "step 1 done",
        Duration::from_secs(120),
    );
    assert_eq!(line, "[rank0]: step 1 done");
    std::fs::write(&go, "").unwrap();
    assert!(child.wait().unwrap().success());
}

/// More ranks than a node runs is refused before anything starts (it used to start
/// processes until the machine ran out, then panic), with the limit named.
#[test]
fn too_many_ranks_are_refused_before_any_starts() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let out = launch(&[
        "--nproc-per-node",
        "100000",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most 1024 ranks per node"), "{err}");
    assert!(!marker.exists(), "a rank started");
}

/// A command that cannot start exits as in a shell and the other commands: 127 when it
/// is not found (a `.py` script is told how to run it), 126 when it is not executable.
#[test]
fn a_command_that_cannot_start_exits_127_or_126() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.py");
    std::fs::write(&script, "print('hi')\n").unwrap();
    let out = launch(&["--nproc-per-node", "2", "--", "no-such-command-here"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found on PATH"));
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .current_dir(dir.path())
        .args(["launch", "--", "train.py"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("run it as `python train.py`"),
        "{out:?}"
    );
    let out = launch(&["--", script.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(126), "{out:?}");
}
