//! `torchtools reserve` and `locks` as users run them: real processes, real locks,
//! signals and `kill -9`. On a machine without NVML the locks are index-keyed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tt_lock::{Holder, LockDir, Wait};

use crate::common::{in_container, key0, pids_of, torchtools, until};

fn run(dir: &Path, args: &[&str]) -> Output {
    torchtools(dir).args(args).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `reserve --gpu 0 --no-fence -- sh -c 'echo ready; exec sleep 60'`, returned once the
/// command runs.
fn reserve_sleeping(dir: &Path) -> (Child, u32) {
    let mut child = torchtools(dir)
        .args(RESERVE_SH)
        .arg("echo ready $$; exec sleep 60")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid = line.trim().strip_prefix("ready ").unwrap().parse().unwrap();
    (child, pid)
}

fn kill(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, signal) };
}

/// `torchtools reserve --gpu 0 --no-fence -- sh -c`, then the script.
const RESERVE_SH: [&str; 7] = ["reserve", "--gpu", "0", "--no-fence", "--", "sh", "-c"];

/// `torchtools reserve --gpu 0 --no-fence -- sh -c SCRIPT`.
fn reserve_sh(dir: &Path, script: &str) -> Output {
    torchtools(dir)
        .args(RESERVE_SH)
        .arg(script)
        .output()
        .unwrap()
}

fn held(dir: &Path) -> bool {
    let locks = LockDir::open(dir).unwrap();
    locks
        .list()
        .unwrap()
        .iter()
        .any(|s| s.gpu == key0() && s.held)
}

#[test]
fn the_commands_exit_status_is_propagated() {
    let tmp = tempfile::tempdir().unwrap();
    let out = reserve_sh(tmp.path(), "exit 3");
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let out = reserve_sh(tmp.path(), "kill -9 $$");
    assert_eq!(out.status.code(), Some(128 + 9), "{}", stderr(&out));
    assert!(!held(tmp.path()), "released after the command");
}

#[test]
fn the_command_sees_its_gpu_and_the_inherited_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let out = reserve_sh(
        tmp.path(),
        "echo $CUDA_VISIBLE_DEVICES; echo $TORCHTOOLS_HELD_LOCKS",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(key0().cuda_visible_entry().as_str()));
    let held = lines.next().unwrap();
    assert!(
        held.starts_with(&format!("{}=", key0().file_name())),
        "{held}"
    );
}

#[test]
fn a_missing_command_exits_127_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(
        tmp.path(),
        &[
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "no-such-command-tt",
        ],
    );
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).contains("cannot run \"no-such-command-tt\""),
        "{}",
        stderr(&out)
    );
    assert!(!held(tmp.path()));
}

#[test]
fn bad_arguments_exit_2_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (
            &["reserve", "--gpu", "0", "--bytes", "6XB", "--", "true"][..],
            "is not a size",
        ),
        (
            &["reserve", "--gpu", "nope", "--no-fence", "--", "true"][..],
            "is not a GPU",
        ),
        (
            &[
                "reserve",
                "--gpu",
                "0",
                "--timeout",
                "soon",
                "--no-fence",
                "--",
                "true",
            ][..],
            "is not a duration",
        ),
        (&["reserve", "--gpu", "0", "--", "true"][..], "give --bytes"),
        (
            &[
                "reserve",
                "--gpu",
                "0",
                "--count",
                "2",
                "--no-fence",
                "--",
                "true",
            ][..],
            "--count",
        ),
        (&["reserve", "--gpu", "0", "--no-fence"][..], "<CMD>"),
        (
            &["reserve", "--gpu", "0", "--share", "--", "true"][..],
            "a shared reservation needs its budget",
        ),
        (
            &[
                "reserve",
                "--gpu",
                "0",
                "--no-cap",
                "--no-fence",
                "--",
                "true",
            ][..],
            "--share",
        ),
        (
            &[
                "reserve", "--share", "--bytes", "1GiB", "--count", "2", "--", "true",
            ][..],
            "one GPU",
        ),
    ] {
        let out = run(tmp.path(), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
    let out = torchtools(tmp.path())
        .env("TORCHTOOLS_LOCK_DIR", "relative/dir")
        .args(["locks"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("TORCHTOOLS_LOCK_DIR=\"relative/dir\""),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_timeout_exits_75_naming_the_holder_and_never_early() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut first, command_pid) = reserve_sleeping(tmp.path());
    until_command_pid_recorded(tmp.path());
    let start = Instant::now();
    let out = run(
        tmp.path(),
        &[
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--timeout",
            "300ms",
            "--",
            "true",
        ],
    );
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(took >= Duration::from_millis(300), "{took:?}");
    let text = stderr(&out);
    assert!(text.contains(&format!("pid {}", first.id())), "{text}");
    assert!(
        text.contains(&format!("command pid {command_pid}")),
        "{text}"
    );
    kill(first.id(), libc::SIGTERM);
    first.wait().unwrap();
}

#[test]
fn kill_9_of_torchtools_alone_keeps_the_gpu_locked_for_the_command() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut tt, command_pid) = reserve_sleeping(tmp.path());
    kill(tt.id(), libc::SIGKILL);
    tt.wait().unwrap();
    assert!(held(tmp.path()), "the command still holds the GPU");
    kill(command_pid, libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(10);
    while held(tmp.path()) {
        assert!(
            Instant::now() < deadline,
            "still held after the command died"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigterm_is_forwarded_and_everything_is_released() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut tt, _command_pid) = reserve_sleeping(tmp.path());
    assert!(held(tmp.path()));
    kill(tt.id(), libc::SIGTERM);
    let status = tt.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
    assert!(!held(tmp.path()));
}

#[test]
fn two_reserves_of_one_gpu_take_turns() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log");
    let script = format!(
        "echo start >> {0}; sleep 0.3; echo end >> {0}",
        log.display()
    );
    let spawn = || {
        torchtools(tmp.path())
            .args(RESERVE_SH)
            .arg(&script)
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (spawn(), spawn());
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        text, "start\nend\nstart\nend\n",
        "the two commands overlapped"
    );
}

/// The held lock as `locks --json` shows it.
fn held_lock(dir: &Path) -> serde_json::Value {
    let out = run(dir, &["locks", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["held"] == true)
        .cloned()
        .unwrap_or_else(|| panic!("{json}"))
}

/// The command of `reserve_sleeping` may print "ready" before `reserve` has written its
/// pid into the lock record: waits for the record to name it (the event).
fn until_command_pid_recorded(dir: &Path) {
    until("the record names the command's pid", || {
        !held_lock(dir)["holder"]["command_pid"].is_null()
    });
}

#[test]
fn locks_shows_the_holder_with_its_command() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut tt, command_pid) = reserve_sleeping(tmp.path());
    until_command_pid_recorded(tmp.path());
    let lock = held_lock(tmp.path());
    assert_eq!(lock["holder"]["pid"], tt.id());
    assert_eq!(lock["holder"]["command_pid"], command_pid);
    assert_eq!(lock["holder"]["command"][0], "sh");
    let text = String::from_utf8(run(tmp.path(), &["locks"]).stdout).unwrap();
    assert!(text.contains(&format!("held by pid {}", tt.id())), "{text}");
    kill(tt.id(), libc::SIGTERM);
    tt.wait().unwrap();
    let text = String::from_utf8(run(tmp.path(), &["locks"]).stdout).unwrap();
    assert!(text.contains(": free"), "{text}");
}

/// Child side of the next test: a program that locks its GPU through tt-lock while
/// running under `torchtools reserve`.
#[test]
#[ignore = "a child process's entry point, run by the reserve tests"]
fn child_locking_under_reserve() {
    if std::env::var_os("TT_CLI_TEST_CHILD").is_none() {
        return;
    }
    let dir = LockDir::from_env().unwrap();
    let lock = dir.lock(&key0(), Wait::Try, Holder::current()).unwrap();
    println!("\n@@inherited={}@@", lock.is_inherited());
}

#[test]
fn a_program_under_reserve_uses_the_inherited_lock_instead_of_waiting_for_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let out = torchtools(tmp.path())
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(tt_testkit::rerun_args("child_locking_under_reserve"))
        .env("TT_CLI_TEST_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("@@inherited=true@@"), "{text}");
    assert!(!held(tmp.path()));
}

#[test]
fn a_command_that_is_not_executable_exits_126_and_an_unusable_lock_directory_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("train.sh");
    std::fs::write(&script, "#!/bin/sh\necho never\n").unwrap(); // mode 0644
    let locks = tmp.path().join("locks");
    let out = run(
        &locks,
        &[
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            script.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(126), "{}", stderr(&out));
    assert!(stderr(&out).contains("not executable"), "{}", stderr(&out));
    assert!(!held(&locks), "the lock is released");
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "--", script.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126), "{}", stderr(&out));
    // A lock directory that is a file: `locks` and `reserve` say so and exit 1.
    let file = tmp.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    for args in [&["locks"][..], &RESERVE_SH[..]] {
        let mut args = args.to_vec();
        if args[0] == "reserve" {
            args.push("true");
        }
        let out = run(&file, &args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("not-a-dir"), "{}", stderr(&out));
    }
}

/// Waits until a request of `pid` is in the queue of `dir`.
fn until_queued(dir: &LockDir, pid: u32) {
    until(&format!("pid {pid} in the queue"), || {
        dir.queue().unwrap().iter().any(|w| w.who.pid == pid)
    });
}

#[test]
fn timed_and_blocking_reservations_are_served_in_arrival_order_and_queue_shows_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = LockDir::open(tmp.path().join("locks")).unwrap();
    let log = tmp.path().join("order.log");
    std::fs::write(&log, "").unwrap();
    let lock = dir.lock(&key0(), Wait::Try, Holder::current()).unwrap();
    // Timed waiters used to poll and be served in any order; blocking ones too when
    // mixed with them.
    let mut children = Vec::new();
    let mut pids = Vec::new();
    for (i, timeout) in ["30s", "", "1m", "45s"].iter().enumerate() {
        let mut cmd = torchtools(dir.path());
        cmd.args(["reserve", "--gpu", "0", "--no-fence"]);
        if !timeout.is_empty() {
            cmd.args(["--timeout", timeout]);
        }
        let child = cmd
            .args(["--bytes", "1GiB", "--", "sh", "-c"])
            .arg(format!("echo {i} >> '{}'", log.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        until_queued(&dir, child.id());
        pids.push(child.id());
        children.push(child);
    }
    let text = String::from_utf8(run(dir.path(), &["queue"]).stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].ends_with("first served): 4"), "{text}");
    assert!(lines[1]
        .split_whitespace()
        .eq(["#", "user", "pid", "waiting", "wants", "bytes", "command"]));
    for (i, pid) in pids.iter().enumerate() {
        let cells: Vec<&str> = lines[i + 2].split_whitespace().collect();
        assert_eq!(cells[0], (i + 1).to_string(), "{text}");
        assert_eq!(cells[2], pid.to_string(), "{text}");
        assert!(lines[i + 2].contains("1.00 GiB"), "{text}");
        assert!(lines[i + 2].contains("sh -c echo"), "{text}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&run(dir.path(), &["queue", "--json"]).stdout).unwrap();
    assert_eq!(pids_of(&json["waiters"]), pids);
    assert!(json["waiters"][0]["waiting_s"].is_u64(), "{json}");
    assert_eq!(json["waiters"][0]["reserved"], 1u64 << 30, "{json}");
    let locks = String::from_utf8(run(dir.path(), &["locks"]).stdout).unwrap();
    assert!(
        locks.contains("; 4 waiting (`torchtools queue`)"),
        "{locks}"
    );
    drop(lock);
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    let order = std::fs::read_to_string(&log).unwrap();
    assert_eq!(order, "0\n1\n2\n3\n");
    let text = String::from_utf8(run(dir.path(), &["queue"]).stdout).unwrap();
    assert!(text.ends_with("first served): 0\n"), "{text}");
}

/// An error is said once: the reservation's error holds the lock directory's, in its
/// message, and a chain printer must not repeat it ("reserving a GPU: X: X").
#[test]
fn a_failure_names_its_cause_once() {
    let out = run(
        Path::new("/proc/no-such-dir/locks"),
        &["reserve", "--gpu", "0", "--no-fence", "--", "true"],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("reserving a GPU: "), "{err}");
    assert_eq!(err.matches("cannot create it").count(), 1, "{err}");
}

/// A lock held from the host is held in a container's views, and the other way round:
/// held is decided on the lock itself (the kernel hides from `/proc/locks` the locks of
/// processes another namespace cannot see), and the holder's PID is said to be from
/// another namespace instead of passing for one of ours.
#[test]
fn locks_are_seen_held_across_pid_namespaces() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let Some(mut container_locks) = in_container(dir) else {
        return;
    };
    // The host holds: the container sees it held, by a process of another namespace.
    let (mut host, command) = reserve_sleeping(dir);
    let out = container_locks.args(["locks", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["locks"][0]["held"], true, "{json}");
    let text = in_container(dir).unwrap().arg("locks").output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(
        text.contains("held by pid") && text.contains("in another PID namespace"),
        "{text}"
    );
    // The command keeps the lock after its reserve: both go.
    // SAFETY: kill(2) of the test's own grandchild.
    unsafe { libc::kill(command as i32, libc::SIGKILL) };
    let _ = host.kill();
    let _ = host.wait();
    // The container holds: the host sees it held, and its pid (1 there) as foreign.
    let mut holder = in_container(dir)
        .unwrap()
        .args(RESERVE_SH)
        .arg("echo ready; exec sleep 60")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let out = run(dir, &["locks"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("held by pid 1 in another PID namespace"),
        "{text}"
    );
    // Killed (the container's whole tree, with its init): free again.
    let _ = holder.kill();
    let _ = holder.wait();
    until("the container's lock is released", || {
        let text = String::from_utf8_lossy(&run(dir, &["locks"]).stdout).into_owned();
        text.contains(": free")
    });
}
