//! The command on a machine of many users: records another user forges are named in
//! `locks`, `queue` and `usage` as ignored, never taken for real, and a second user's
//! `reserve` still names the real holder. (tt-lock's `tests/trust.rs` tries every
//! record kind through the API; this is what users of the command see.)

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{ok, torchtools};

/// A request for GPU 0 that gives up after a second (exit 75 when it is taken).
const TRY_GPU0: [&str; 8] = [
    "reserve",
    "--gpu",
    "0",
    "--no-fence",
    "--timeout",
    "1s",
    "--",
    "true",
];

/// The first line `child` prints (its standard output piped), trimmed.
fn first_line(child: &mut std::process::Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim().to_owned()
}

#[test]
fn forged_records_are_said_by_every_view_and_reserve_names_the_real_holder() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path().join("locks");
    let as_nobody = |program: &str| {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--", program])
            .env("TORCHTOOLS_LOCK_DIR", &dir)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .stdin(Stdio::null());
        c
    };
    // Root holds GPU 0, torchtools itself under `umask 077` (its records must stay
    // readable by every user).
    let mut held = torchtools(&dir);
    // SAFETY: umask is async-signal-safe and allocates nothing.
    unsafe {
        held.pre_exec(|| {
            libc::umask(0o077);
            Ok(())
        });
    }
    let mut held = held
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "echo ready; exec sleep 600"])
        .process_group(0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut held), "ready");
    let root_pid = held.id();
    // nobody plants a holder record and a queue ticket claiming root, each locked as a
    // live record is (a write lock on the open file, F_OFD_SETLK = 37 with F_WRLCK = 1,
    // through perl: it can, the files are its own), and a usage log of its own claiming
    // root.
    let forge = format!(
        "cd {dir} && printf '{{\"pid\":1,\"user\":\"root\",\"host\":\"h\",\"since_unix\":1}}\\n' \
         > held-gpu-0.1-0-1-0.json && printf '{{\"ticket\":9,\"pid\":1,\"user\":\"root\",\
         \"host\":\"h\",\"since_unix\":1,\"wants\":{{\"kind\":\"gpus\",\"gpus\":[{{\"index\":0}}]}}}}\\n' \
         > wait-00000000000000000009.json && printf '{{\"event\":\"start\",\"id\":\"f\",\
         \"user\":\"root\",\"host\":\"h\",\"pid\":1,\"gpu\":\"0\",\"bytes\":null,\"time\":1,\
         \"command\":[]}}\\n' > usage-65534.jsonl && echo forged && \
         exec perl -e 'for (@ARGV) {{ open(my $f, \"+<\", $_) or die; push @k, $f; \
         my $l = pack(\"s s x4 q q i x4\", 1, 0, 0, 0, 0); fcntl($f, 37, $l) or die \"$_: $!\" }} \
         sleep 600' held-gpu-0.1-0-1-0.json wait-00000000000000000009.json",
        dir = dir.display()
    );
    let mut forger = as_nobody("sh")
        .args(["-c", &forge])
        .process_group(0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut forger), "forged");
    let view = |args: &[&str]| {
        crate::common::until("the forged records locked", || {
            let out = torchtools(&dir).arg("locks").output().unwrap();
            String::from_utf8_lossy(&out.stdout).contains("records ignored")
        });
        let out = torchtools(&dir).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let says = "written by uid 65534 (nobody), claims root";
    let locks = view(&["locks"]);
    assert!(
        locks.contains(&format!("held by pid {root_pid} (root@")),
        "{locks}"
    );
    assert!(
        locks.contains("2 records ignored:") && locks.contains(says),
        "{locks}"
    );
    let queue = view(&["queue"]);
    assert!(queue.contains(says), "{queue}");
    let queue: serde_json::Value = serde_json::from_str(&view(&["queue", "--json"])).unwrap();
    assert_eq!(
        queue["waiters"],
        serde_json::json!([]),
        "the forged ticket is no request: {queue}"
    );
    let usage = view(&["usage", "--by", "user"]);
    assert!(
        usage.contains("1 record ignored:") && usage.contains(says),
        "{usage}"
    );
    // Root's one reservation, running; not the forged one besides.
    let usage: serde_json::Value =
        serde_json::from_str(&view(&["usage", "--by", "user", "--json"])).unwrap();
    let rows = usage["rows"].as_array().unwrap();
    let root: Vec<_> = rows.iter().filter(|r| r["name"] == "root").collect();
    assert!(
        root.len() == 1 && root[0]["reservations"] == 1 && root[0]["running"] == 1,
        "{usage}"
    );
    // nobody's own request meets the real holder.
    let out = as_nobody(env!("CARGO_BIN_EXE_torchtools"))
        .args(TRY_GPU0)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("pid {root_pid} (root@")), "{err}");
    // Each group whole (torchtools and its command; runuser and the forger's shell,
    // flocks and sleep): nothing of the test outlives it.
    for mut child in [held, forger] {
        // SAFETY: kill(2) of a process group this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
}

/// `torchtools` as `user` (`tt-test-a`, `tt-test-b`, `nobody`), with `dir` as its lock
/// directory and `home` for its state and config (logs, no machine-wide hook).
fn as_user(user: &str, dir: &Path, home: &Path) -> Command {
    let mut c = runuser(user, dir, home);
    c.arg(env!("CARGO_BIN_EXE_torchtools"));
    c
}

/// `runuser -u user --`, to be given a program, with the environment [`as_user`] gives
/// `torchtools`.
fn runuser(user: &str, dir: &Path, home: &Path) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", user, "--"])
        .env("TORCHTOOLS_LOCK_DIR", dir)
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .env_remove("TORCHTOOLS_JOB_ID")
        .stdin(Stdio::null());
    c
}

/// `command` (a `torchtools` to run) reserving GPU 0 for a shell that sleeps, `more`
/// its further arguments, in a process group of its own: returned once it holds.
fn holding_gpu_0(mut command: Command, more: &[&str]) -> std::process::Child {
    let mut held = command
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "echo ready; exec sleep 600"])
        .args(more)
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut held), "ready");
    held
}

/// `sh -c script` as `user`, in `dir`.
fn shell_as(user: &str, dir: &Path, script: &str) -> std::process::Output {
    Command::new("runuser")
        .args(["-u", user, "--", "sh", "-c", script])
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// A home of its own for `user` under the shared `tmp` (only they can write it).
fn home_of(tmp: &Path, user: &str) -> std::path::PathBuf {
    let home = tmp.join(user);
    std::fs::create_dir(&home).unwrap();
    let out = Command::new("chown").arg(user).arg(&home).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    home
}

/// Waits for `child` for up to [`crate::common::PATIENCE`]: `None` (the child killed) when it
/// is still running then.
fn wait_bounded(mut child: std::process::Child) -> Option<std::process::Output> {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > crate::common::PATIENCE {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Some(child.wait_with_output().unwrap())
}

/// A job record `user` writes of their own (JSON), as `job-ID.json`.
fn job_record(id: &str, user: &str, uid: u32, pid: u32, keeper: u32, log: &Path) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    serde_json::json!({
        "id": id, "user": user, "uid": uid, "host": "h", "boot_id": boot.trim(),
        "command": ["reserve", "--", "sleep", "600"], "log": log, "started_unix": now,
        "keeper_pid": keeper, "pid": pid,
    })
    .to_string()
}

#[test]
fn another_users_job_records_never_take_a_jobs_id_and_stop_and_logs_touch_only_the_job() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let [a, _] = tt_testkit::users::two_users().unwrap();
    let user_a = tt_testkit::users::USER_NAMES[0];
    let dir = tmp.path().join("locks");
    let home = home_of(tmp.path(), user_a);
    let out = as_user(user_a, &dir, &home)
        .args(["reserve", "--detach", "--gpu", "0", "--no-fence", "--"])
        .args(["sleep", "600"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    // nobody writes records of its own: one naming A's job id under another file name,
    // one whose id A's id is a prefix of.
    let vandal = tmp.path().join("vandal");
    std::fs::create_dir(&vandal).unwrap();
    let vlog = vandal.join("log");
    for (file, claimed) in [
        ("evil".to_owned(), id.clone()),
        (format!("{id}-x"), format!("{id}-x")),
    ] {
        let record = job_record(&claimed, "nobody", 65_534, 1, 1, &vlog);
        let out = shell_as(
            "nobody",
            &dir,
            &format!("printf '%s' '{record}' > job-{file}.json"),
        );
        assert!(out.status.success(), "{out:?}");
    }
    // A's id still names A's job, for `logs`, `jobs wait` and `stop`.
    let logs = as_user(user_a, &dir, &home)
        .args(["logs", &id])
        .output()
        .unwrap();
    assert!(logs.status.success(), "{logs:?}");
    let listed = as_user(user_a, &dir, &home)
        .args(["jobs", "--all"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("not the job of its file name"),
        "{listed:?}"
    );
    // A record of A's own naming an older process of A's as its job: `stop` leaves it.
    let mut innocent = Command::new("runuser")
        .args(["-u", user_a, "--", "sleep", "600"])
        .process_group(0)
        .spawn()
        .unwrap();
    // runuser forks: the sleep is its child, A's.
    let mut victim = 0;
    crate::common::until("A's sleep runs", || {
        victim = pgrep(innocent.id(), a.uid);
        victim != 0
    });
    // The record's job starts well after the innocent process (btime has whole seconds).
    std::thread::sleep(std::time::Duration::from_secs(3));
    let record = job_record("mine", user_a, a.uid, victim, victim, &home.join("fifo"));
    let out = shell_as(
        user_a,
        &dir,
        &format!(
            "printf '%s' '{record}' > job-mine.json && mkfifo {}",
            home.join("fifo").display()
        ),
    );
    assert!(out.status.success(), "{out:?}");
    let stopped = as_user(user_a, &dir, &home)
        .args(["stop", "mine", "--grace", "1s"])
        .output()
        .unwrap();
    assert!(
        tt_device::procfs::stat(victim).is_some_and(|s| !s.exited()),
        "stop signalled a process that is not the job's: {stopped:?}"
    );
    // A log that is a FIFO: `logs` says so instead of waiting for a writer for ever.
    let logs = as_user(user_a, &dir, &home)
        .args(["logs", "mine"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let logs = wait_bounded(logs).expect("`logs` of a FIFO hung");
    assert_eq!(logs.status.code(), Some(1), "{logs:?}");
    assert!(
        String::from_utf8_lossy(&logs.stderr).contains("not a regular file"),
        "{logs:?}"
    );
    let out = as_user(user_a, &dir, &home)
        .args(["stop", &id])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // SAFETY: kill(2) of a process group this test started.
    unsafe { libc::kill(-(innocent.id() as i32), libc::SIGKILL) };
    let _ = innocent.wait();
}

/// The pid of `parent`'s child that belongs to `uid` (0 while there is none).
fn pgrep(parent: u32, uid: u32) -> u32 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|&pid| {
            tt_device::procfs::stat(pid).is_some_and(|s| s.ppid == parent)
                && tt_device::procfs::status(pid).and_then(|s| s.uid) == Some(uid)
        })
        .unwrap_or(0)
}

#[test]
fn metrics_textfile_never_writes_through_a_planted_link() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    // A collector directory others can write (not sticky: the kernel's
    // protected_symlinks would not step in), and a file of root's elsewhere.
    let out_dir = tmp.path().join("textfile");
    std::fs::create_dir(&out_dir).unwrap();
    std::fs::set_permissions(
        &out_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let precious = tmp.path().join("precious");
    std::fs::write(&precious, "root's\n").unwrap();
    // The writer waits for a line before it becomes `metrics` (same pid): nobody plants
    // a link under the temporary name it will use first.
    let mut writer = Command::new("sh")
        .args([
            "-c",
            "read go; exec \"$0\" metrics --textfile \"$1\" --interval 1s",
        ])
        .arg(env!("CARGO_BIN_EXE_torchtools"))
        .arg(&out_dir)
        .env("TORCHTOOLS_LOCK_DIR", tmp.path().join("locks"))
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let temp = out_dir.join(format!(".torchtools.prom.{}", writer.id()));
    let out = shell_as(
        "nobody",
        tmp.path(),
        &format!("ln -s {} {}", precious.display(), temp.display()),
    );
    assert!(out.status.success(), "{out:?}");
    use std::io::Write;
    writer.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = wait_bounded(writer).expect("metrics --textfile kept running past a planted link");
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "root's\n");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("never followed"),
        "{out:?}"
    );
}

#[test]
fn a_lock_directory_or_lock_file_another_user_created_is_said_with_roots_fix() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    tt_testkit::users::two_users().unwrap();
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    // A creates the directory first (as after a reboot emptied /tmp).
    let dir = tmp.path().join("locks");
    let home_a = home_of(tmp.path(), user_a);
    let out = as_user(user_a, &dir, &home_a)
        .arg("locks")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("belongs to"),
        "{out:?}"
    );
    let home_b = home_of(tmp.path(), user_b);
    let out = as_user(user_b, &dir, &home_b)
        .arg("locks")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("belongs to {user_a}"))
            && err.contains("/etc/tmpfiles.d/torchtools.conf")
            && err.contains("1777 root root"),
        "{out:?}"
    );
    // A's lock file (A reserved GPU 0 first) is said to B, with root's set-up.
    let out = as_user(user_a, &dir, &home_a)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = as_user(user_b, &dir, &home_b)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("gpu-0.lock belongs to {user_a}"))
            && err.contains("sudo torchtools reserve --gpu N --no-fence -- true"),
        "{out:?}"
    );
}

#[test]
fn a_bare_shared_flock_on_a_gpus_lock_is_shown_in_every_view_not_called_free() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path().join("locks");
    // The lock file, made by a first reservation.
    let out = torchtools(&dir)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut vandal = Command::new("runuser")
        .args(["-u", "nobody", "--", "flock", "-s", "gpu-0.lock", "-c"])
        .arg("echo locked; exec sleep 600")
        .current_dir(&dir)
        .process_group(0)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut vandal), "locked");
    let says = |args: &[&str]| {
        let out = torchtools(&dir).args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let locks = says(&["locks"]);
    assert!(
        locks.contains("(nobody) with no reservation record") && !locks.contains(": free"),
        "{locks}"
    );
    let top = says(&["top", "--once"]);
    assert!(
        top.contains("(nobody) with no reservation record") && !top.contains("\nfree"),
        "{top}"
    );
    let top: serde_json::Value = serde_json::from_str(&says(&["top", "--json"])).unwrap();
    assert_eq!(top["gpus"][0]["unrecorded"][0]["user"], "nobody", "{top}");
    let metrics = says(&["metrics"]);
    assert!(
        metrics
            .lines()
            .filter(|l| l.starts_with("torchtools_gpu_locked{"))
            .any(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(1.0)),
        "{metrics}"
    );
    // What the views say is what a request meets.
    let out = torchtools(&dir).args(TRY_GPU0).output().unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    // SAFETY: kill(2) of a process group this test started.
    unsafe { libc::kill(-(vandal.id() as i32), libc::SIGKILL) };
    let _ = vandal.wait();
}

#[test]
fn terminal_escapes_in_records_are_shown_as_text_by_every_view() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    tt_testkit::users::two_users().unwrap();
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let dir = tmp.path().join("locks");
    let home_a = home_of(tmp.path(), user_a);
    let home_b = home_of(tmp.path(), user_b);
    // A's command line retitles and clears the terminal of whoever prints it raw.
    let escape = "\x1b]0;pwned\x07\x1b[2J";
    let mut held = holding_gpu_0(as_user(user_a, &dir, &home_a), &[escape]);
    // B waits for the GPU with the escape in its own command line: `queue` shows it.
    let mut waiting = as_user(user_b, &dir, &home_b)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "exec sleep 600", escape])
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let queued = Instant::now();
    loop {
        let out = as_user(user_b, &dir, &home_b)
            .args(["queue", "--json"])
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if json["waiters"].as_array().is_some_and(|w| !w.is_empty()) {
            break;
        }
        assert!(
            queued.elapsed() < Duration::from_secs(120),
            "B's request never queued: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // nobody's own job record, its id (and so its file's name) an escape.
    let record = job_record("\x1b[2J", "nobody", 65_534, 1, 1, Path::new("/dev/null"));
    std::fs::write(dir.join("job-\x1b[2J.json"), record).unwrap();
    let out = Command::new("chown")
        .arg("nobody")
        .arg(dir.join("job-\x1b[2J.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    for args in [
        &["locks"][..],
        &["top", "--once"],
        &["jobs", "--all"],
        &["metrics"],
        &["queue"],
    ] {
        // (`top --once` as wide as the commands, which a narrow frame would cut off.)
        let out = as_user(user_b, &dir, &home_b)
            .env("COLUMNS", "400")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.stdout.contains(&0x1b) && !out.stdout.contains(&0x07),
            "{args:?} printed a raw escape: {text:?}"
        );
        // Shown, as text: the holder's command (locks, top), the waiter's (queue, top),
        // the job's id (jobs).
        if args[0] != "metrics" {
            assert!(text.contains("\\x1b"), "{args:?}: {text:?}");
        }
    }
    for child in [&mut held, &mut waiting] {
        // SAFETY: kill(2) of a process group this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        let _ = child.wait();
    }
}

#[test]
fn an_on_end_command_is_never_in_the_arguments_other_users_read_and_still_runs() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let [a, _] = tt_testkit::users::two_users().unwrap();
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let dir = tmp.path().join("locks");
    let home = home_of(tmp.path(), user_a);
    let ran = home.join("hook-ran");
    let hook = format!(
        "echo $TORCHTOOLS_JOB_STATUS > {}; : token-s3cr3t",
        ran.display()
    );
    let mut held = as_user(user_a, &dir, &home)
        .args([
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--on-end",
            &hook,
            "--",
        ])
        .args(["sh", "-c", "echo ready; exec sleep 600"])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut held), "ready");
    let torchtools = pgrep(held.id(), a.uid);
    assert_ne!(torchtools, 0);
    let seen = Command::new("runuser")
        .args(["-u", user_b, "--", "cat"])
        .arg(format!("/proc/{torchtools}/cmdline"))
        .output()
        .unwrap();
    let seen = String::from_utf8_lossy(&seen.stdout).replace('\0', " ");
    assert!(
        seen.contains("reserve") && seen.contains("--gpu"),
        "{seen:?}"
    );
    assert!(
        !seen.contains("s3cr3t"),
        "another user reads the hook: {seen:?}"
    );
    // The hook still runs when the job ends.
    // SAFETY: kill(2) of a process this test started (through runuser).
    unsafe { libc::kill(torchtools as i32, libc::SIGTERM) };
    crate::common::until("the hook ran", || {
        std::fs::read_to_string(&ran).is_ok_and(|s| s.ends_with('\n'))
    });
    // SAFETY: kill(2) of a process group this test started.
    unsafe { libc::kill(-(held.id() as i32), libc::SIGKILL) };
    let _ = held.wait();
}

/// Process groups killed when the test ends, however it ends: a failing test leaves no
/// loop or queued request behind to burn the machine's CPUs.
struct Groups(Vec<u32>);

impl Drop for Groups {
    fn drop(&mut self) {
        for &group in &self.0 {
            // SAFETY: kill(2) of a process group this test started.
            unsafe { libc::kill(-(group as i32), libc::SIGKILL) };
        }
    }
}

/// A machine of several users under a policy of root's holding `text`: the shared
/// scratch directory (None, said, without root), its lock directory (root's) and the
/// policy file.
fn under_policy(text: &str) -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf)> {
    let (tmp, dir) = shared_machine()?;
    let policy = policy_file(tmp.path(), text, "root", 0o644);
    Some((tmp, dir, policy))
}

/// A machine of several users: the shared scratch directory (None, said, without
/// root), the test users made, and its lock directory, root's.
fn shared_machine() -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    let tmp = crate::common::shared_dir_for_two_users()?;
    tt_testkit::users::two_users().unwrap();
    let dir = tmp.path().join("locks");
    ok(torchtools(&dir).arg("locks").output().unwrap());
    Some((tmp, dir))
}

/// `tmp/policy.toml` holding `text`, owned by `owner` with `mode`.
fn policy_file(tmp: &Path, text: &str, owner: &str, mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = tmp.join("policy.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new("chown")
        .arg(owner)
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

#[test]
fn a_policy_file_another_user_could_write_is_ignored_and_said_by_every_view() {
    let Some((tmp, dir)) = shared_machine() else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let home_b = home_of(tmp.path(), user_b);
    let as_b = |policy: &Path, args: &[&str]| {
        let out = as_user(user_b, &dir, &home_b)
            .env("TORCHTOOLS_POLICY", policy)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // Written by an ordinary user: ignored, in `policy` (exit 1) and the views.
    let policy = policy_file(tmp.path(), "[limits]\ngpus = 1\n", user_a, 0o644);
    let (code, out) = as_b(&policy, &["policy"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("is ignored: it belongs to {user_a}"))
            && out.contains("served first come, first served"),
        "{out}"
    );
    for view in [&["locks"][..], &["queue"], &["usage"], &["jobs", "--all"]] {
        let (code, out) = as_b(&policy, view);
        assert_eq!(code, Some(0), "{view:?}: {out}");
        assert!(out.contains("is ignored: it belongs to"), "{view:?}: {out}");
    }
    let (_, top) = as_b(&policy, &["top", "--json"]);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&top).unwrap()["policy_ignored"],
        true
    );
    let (_, metrics) = as_b(&policy, &["metrics"]);
    assert!(metrics.contains("torchtools_policy_ignored 1"), "{metrics}");
    // Root's, but writable by others: ignored.
    let policy = policy_file(tmp.path(), "[limits]\ngpus = 1\n", "root", 0o666);
    let (code, out) = as_b(&policy, &["policy"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("other users can write it (mode 666)"), "{out}");
    // Root's and only root's to write: in force, said as such.
    let policy = policy_file(tmp.path(), "[limits]\ngpus = 1\n", "root", 0o644);
    let (code, out) = as_b(&policy, &["policy"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("first come, first served; per user at once: 1 GPU(s)"),
        "{out}"
    );
    let (_, out) = as_b(&policy, &["locks"]);
    assert!(!out.contains("ignored"), "{out}");
    // An unknown key: ignored, the key named.
    let policy = policy_file(tmp.path(), "[limits]\ngpu = 1\n", "root", 0o644);
    let (code, out) = as_b(&policy, &["policy"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("unknown field `gpu`"), "{out}");
}

#[test]
fn a_request_past_its_users_limit_waits_marked_held_and_blocks_nobody() {
    let Some((tmp, dir, policy)) = under_policy("[limits]\ngpus = 1\nqueued = 1\n") else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let home_a = home_of(tmp.path(), user_a);
    let home_b = home_of(tmp.path(), user_b);
    let tt_as = |user: &str, home: &Path| {
        let mut c = as_user(user, &dir, home);
        c.env("TORCHTOOLS_POLICY", &policy);
        c
    };
    // A holds GPU 0 until told, then asks for GPU 1 (free): held, one GPU is A's limit.
    let mut holding = tt_as(user_a, &home_a)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "echo ready; read x; exit 0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut holding), "ready");
    let second = tt_as(user_a, &home_a)
        .args(["reserve", "--gpu", "1", "--no-fence", "--", "echo", "got 1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let queue = || -> serde_json::Value {
        let out = torchtools(&dir)
            .env("TORCHTOOLS_POLICY", &policy)
            .args(["queue", "--json"])
            .output()
            .unwrap();
        serde_json::from_str(&ok(out)).unwrap()
    };
    crate::common::until("A's second request in the queue", || {
        queue()["waiters"].as_array().is_some_and(|w| w.len() == 1)
    });
    let q = queue();
    assert_eq!(
        q["waiters"][0]["held"], "held by policy: 1 of 1 GPU(s) held, 1 more asked",
        "{q}"
    );
    let text = ok(torchtools(&dir)
        .env("TORCHTOOLS_POLICY", &policy)
        .arg("queue")
        .output()
        .unwrap());
    assert!(
        text.contains("held by policy: 1 of 1 GPU(s) held"),
        "{text}"
    );
    // B's request for GPU 1, later, is served at once: a held request blocks nobody.
    let out = tt_as(user_b, &home_b)
        .args([
            "reserve",
            "--gpu",
            "1",
            "--no-fence",
            "--timeout",
            "60s",
            "--",
        ])
        .args(["echo", "B got 1"])
        .output()
        .unwrap();
    assert_eq!(ok(out).trim(), "B got 1");
    // A may have one request waiting: a second one is refused, saying why.
    let out = tt_as(user_a, &home_a)
        .args(["reserve", "--gpu", "2", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may have at most 1 at once"),
        "{out:?}"
    );
    // A lets go of GPU 0: A's request for GPU 1 is served.
    drop(holding.stdin.take());
    assert!(holding.wait().unwrap().success());
    let out = wait_bounded(second).expect("A's held request served once A let go");
    assert_eq!(ok(out).trim(), "got 1");
}

#[test]
fn with_fair_share_one_users_twenty_queued_jobs_no_longer_stand_before_the_others() {
    let Some((tmp, dir, policy)) = under_policy("[fair_share]\nhalf_life = \"1h\"\n") else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    // nobody holds GPU 0 while everyone queues (nobody's use is not measured).
    let home_n = home_of(tmp.path(), "nobody");
    let mut gate = as_user("nobody", &dir, &home_n)
        .env("TORCHTOOLS_POLICY", &policy)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(["sh", "-c", "echo ready; read x; exit 0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut gate), "ready");
    // Jobs of different lengths: serving the users in turn would give A three times
    // B's GPU time; the fair share gives each the same.
    let job = |secs: &'static str| ["reserve", "--gpu", "0", "--no-fence", "--", "sleep", secs];
    // root queues twenty jobs at once.
    let roots: Vec<_> = (0..20)
        .map(|_| {
            torchtools(&dir)
                .env("TORCHTOOLS_POLICY", &policy)
                .args(job("0.4"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .unwrap()
        })
        .collect();
    let mut groups = Groups(roots.iter().map(std::process::Child::id).collect());
    // A and B each keep two requests going until told to stop.
    let stop = tmp.path().join("stop");
    let loops: Vec<_> = [
        (user_a, "0.6"),
        (user_a, "0.6"),
        (user_b, "0.2"),
        (user_b, "0.2"),
    ]
    .into_iter()
    .map(|(user, secs)| {
        let home = tmp.path().join(format!("home-{user}"));
        let _ = std::fs::create_dir(&home);
        let _ = Command::new("chown").arg(user).arg(&home).output();
        let script = format!(
            "while [ ! -e {stop} ]; do \"$0\" {job} >/dev/null 2>&1 || exit 1; done",
            stop = stop.display(),
            job = job(secs).join(" ")
        );
        runuser(user, &dir, &home)
            .args(["sh", "-c", &script])
            .arg(env!("CARGO_BIN_EXE_torchtools"))
            .env("TORCHTOOLS_POLICY", &policy)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap()
    })
    .collect();
    groups.0.extend(loops.iter().map(std::process::Child::id));
    groups.0.push(gate.id());
    crate::common::until(
        "twenty of root's requests and two each of A's and B's waiting",
        || {
            let out = torchtools(&dir).args(["queue", "--json"]).output().unwrap();
            let q: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
            let count = |user: &str| {
                q["waiters"]
                    .as_array()
                    .map_or(0, |w| w.iter().filter(|w| w["user"] == user).count())
            };
            count("root") == 20 && count(user_a) == 2 && count(user_b) == 2
        },
    );
    let queue = ok(torchtools(&dir)
        .env("TORCHTOOLS_POLICY", &policy)
        .arg("queue")
        .output()
        .unwrap());
    assert!(
        queue.contains("served by the policy") && queue.contains("GPU-h recent use"),
        "{queue}"
    );
    // Let go: from now on all three have work waiting until root's last job ends.
    let opened = tt_device::now_unix();
    drop(gate.stdin.take());
    assert!(gate.wait().unwrap().success());
    for child in roots {
        let out = wait_bounded(child).expect("root's queued job served");
        assert!(out.status.success(), "{out:?}");
    }
    std::fs::write(&stop, "").unwrap();
    for child in loops {
        let out = wait_bounded(child).expect("a user's loop stopped");
        assert!(out.status.success(), "{out:?}");
    }
    // GPU-seconds each got between the gate and root's last job's end.
    let usage = tt_lock::LockDir::open(&dir).unwrap().usage().unwrap();
    let closed = usage
        .records
        .iter()
        .filter(|r| r.user == "root")
        .filter_map(|r| r.ended_unix)
        .fold(opened, f64::max);
    let got = |user: &str| -> f64 {
        usage
            .records
            .iter()
            .filter(|r| r.user == user)
            .map(|r| {
                (r.ended_unix.unwrap_or(closed).min(closed) - r.since_unix.max(opened)).max(0.0)
            })
            .sum()
    };
    // Each user's standing, as `top --json` and `metrics` show it.
    let top: serde_json::Value = serde_json::from_str(&ok(torchtools(&dir)
        .env("TORCHTOOLS_POLICY", &policy)
        .args(["top", "--json"])
        .output()
        .unwrap()))
    .unwrap();
    let users: Vec<&str> = top["users"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|u| u["user"].as_str())
        .collect();
    for user in ["root", user_a, user_b] {
        assert!(users.contains(&user), "{top}");
    }
    let metrics = ok(torchtools(&dir)
        .env("TORCHTOOLS_POLICY", &policy)
        .arg("metrics")
        .output()
        .unwrap());
    assert!(
        metrics.contains(&format!(
            "torchtools_fair_share_fraction{{user=\"{user_a}\"}}"
        )),
        "{metrics}"
    );
    let [root, a, b] = [got("root"), got(user_a), got(user_b)];
    let equal = (root + a + b) / 3.0;
    eprintln!(
        "GPU-seconds while all three waited: root {root:.2}, {user_a} {a:.2}, {user_b} {b:.2}"
    );
    // (Turns would give root, A and B 1.0, 1.5 and 0.5 of equal; a job's length is
    // up to 8% of a user's time here.)
    for (user, seconds) in [("root", root), (user_a, a), (user_b, b)] {
        assert!(
            (seconds / equal - 1.0).abs() <= 0.2,
            "{user} got {seconds:.2} GPU-s of the {:.2} while all three waited \
             (root {root:.2}, {user_a} {a:.2}, {user_b} {b:.2}): not within 20% of equal",
            3.0 * equal
        );
    }
}

#[test]
fn a_preemptible_job_above_its_share_yields_to_a_long_wait_and_is_requeued() {
    let Some((tmp, dir, policy)) = under_policy(
        "[fair_share]\nhalf_life = \"1h\"\n[preemption]\nafter = \"1s\"\ngrace = \"60s\"\n",
    ) else {
        return;
    };
    let [user_a, _] = tt_testkit::users::USER_NAMES;
    let root_home = tmp.path().join("root-home");
    let root = || {
        let mut c = torchtools(&dir);
        c.env("TORCHTOOLS_POLICY", &policy)
            .env("XDG_STATE_HOME", root_home.join("state"))
            .env("XDG_CONFIG_HOME", root_home.join("config"))
            .env_remove("TORCHTOOLS_JOB_ID");
        c
    };
    let job = |id: &str| -> serde_json::Value {
        let all: serde_json::Value =
            serde_json::from_str(&ok(root().args(["jobs", "--json"]).output().unwrap())).unwrap();
        all.as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id)
            .cloned()
            .unwrap()
    };
    // root: a preemptible job on GPU 0 (it checkpoints on SIGTERM; its second run
    // finishes), and one that is not preemptible on GPU 1.
    let runs = tmp.path().join("runs");
    let script = format!(
        "echo run $TORCHTOOLS_JOB_RUN >> {r}; [ $TORCHTOOLS_JOB_RUN -ge 2 ] && exit 0; \
         trap 'echo checkpointed >> {r}; exit 75' TERM; while :; do sleep 0.05; done",
        r = runs.display()
    );
    let detach = |args: &[&str]| {
        ok(root()
            .args(["reserve", "--detach"])
            .args(args)
            .output()
            .unwrap())
        .trim()
        .to_owned()
    };
    let preemptible = detach(&[
        "--preemptible",
        "--gpu",
        "0",
        "--no-fence",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let steady = detach(&[
        "--gpu",
        "1",
        "--no-fence",
        "--",
        "sh",
        "-c",
        "exec sleep 600",
    ]);
    crate::common::until("both of root's jobs run", || {
        job(&preemptible)["state"] == "running" && job(&steady)["state"] == "running"
    });
    // A asks for GPU 0: after a second of waiting, root's job yields it.
    let home_a = home_of(tmp.path(), user_a);
    let tt_a = || {
        let mut c = as_user(user_a, &dir, &home_a);
        c.env("TORCHTOOLS_POLICY", &policy);
        c
    };
    let asked = tt_a()
        .args([
            "reserve",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "echo",
            "A got GPU 0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let log = std::path::PathBuf::from(job(&preemptible)["log"].as_str().unwrap());
    crate::common::until("root's job preempted", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("torchtools: preempted: pid"))
    });
    let decided = tt_device::now_unix();
    let out = wait_bounded(asked).expect("A served once root's job yielded");
    assert_eq!(ok(out).trim(), "A got GPU 0");
    let out = root()
        .args(["jobs", "wait", &preemptible])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(job(&preemptible)["state"], "finished (run 2)");
    assert_eq!(
        std::fs::read_to_string(&runs).unwrap(),
        "run 1\ncheckpointed\nrun 2\n"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains(&format!("({user_a}) has waited")) && said.contains("above their fair share"),
        "{said}"
    );
    // How long from the decision (seen in the log) to GPU 0 being free (root's record
    // of it ended) and to A holding it.
    let usage = tt_lock::LockDir::open(&dir).unwrap().usage().unwrap();
    let freed = usage
        .records
        .iter()
        .filter(|r| r.user == "root" && r.gpu.ends_with('0'))
        .filter_map(|r| r.ended_unix)
        .find(|&end| end >= decided - 1.0);
    let served = usage
        .records
        .iter()
        .find(|r| r.user == user_a)
        .map(|r| r.since_unix);
    eprintln!(
        "preemption: decision seen at {decided:.3}, GPU 0 free {:.3} s later, A served {:.3} s later",
        freed.unwrap_or(f64::NAN) - decided,
        served.unwrap_or(f64::NAN) - decided
    );
    // The job that is not preemptible is never touched: A's wait for GPU 1 runs out,
    // ten times the policy's `after` (and its look every half second) later.
    let out = tt_a()
        .args([
            "reserve",
            "--gpu",
            "1",
            "--no-fence",
            "--timeout",
            "10s",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert_eq!(job(&steady)["state"], "running");
    let steady_log = std::path::PathBuf::from(job(&steady)["log"].as_str().unwrap());
    let said = std::fs::read_to_string(&steady_log).unwrap();
    assert!(!said.contains("preempted"), "{said}");
    ok(root().args(["stop", &steady]).output().unwrap());
}

/// `torchtools ARGS` as `user` with `TORCHTOOLS_POLICY` naming `named`, in a mount
/// namespace whose `/etc` (an overlay of the real one, nothing written to it) holds the
/// machine's policy `/etc/torchtools/policy.toml`, root's, holding `machine`.
fn beside_machine_policy(
    tmp: &Path,
    machine: &str,
    user: &str,
    named: &Path,
    dir: &Path,
    args: &[&str],
) -> std::process::Output {
    let layers = tempfile::tempdir().unwrap();
    let script = r#"set -e
mkdir -p "$LAYERS/up" "$LAYERS/work"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$LAYERS/up,workdir=$LAYERS/work" /etc
mkdir -p /etc/torchtools
printf '%s' "$MACHINE" > /etc/torchtools/policy.toml
chmod 644 /etc/torchtools/policy.toml
user=$1; shift
exec runuser -u "$user" -- "$@""#;
    let home = home_of(tmp, user);
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(user)
        .arg(env!("CARGO_BIN_EXE_torchtools"))
        .args(args)
        .env("LAYERS", layers.path())
        .env("MACHINE", machine)
        .env("TORCHTOOLS_POLICY", named)
        .env("TORCHTOOLS_LOCK_DIR", dir)
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .env_remove("TORCHTOOLS_JOB_ID")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("mount:"),
        "the overlay of /etc could not be made: {out:?}"
    );
    out
}

/// Where the machine has a policy (`/etc/torchtools/policy.toml`), no variable leaves
/// it behind: `TORCHTOOLS_POLICY` naming a file that does not exist (no policy) or a
/// laxer one of the user's, a request past the machine's `time_max` is still refused
/// before anything runs, and `policy` says which file is the policy and that the
/// variable is not read.
#[test]
fn no_variable_leaves_the_machines_policy_behind() {
    let Some((tmp, dir)) = shared_machine() else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let machine = "[limits]\ngpus = 1\ntime_max = \"1h\"\n";
    let laxer = policy_file(tmp.path(), "[limits]\ntime_max = \"1d\"\n", user_b, 0o644);
    let cases = [
        (user_b, Path::new("/nonexistent/policy.toml")),
        (user_b, laxer.as_path()),
    ];
    for (user, named) in cases {
        let reserve = [
            "reserve",
            "--time",
            "2h",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ];
        let out = beside_machine_policy(tmp.path(), machine, user, named, &dir, &reserve);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{named:?}: {out:?}");
        assert!(
            err.contains("/etc/torchtools/policy.toml")
                && err.contains("1h")
                && err.contains("TORCHTOOLS_POLICY=")
                && err.contains("is not read"),
            "{named:?}: {err}"
        );
        let _ = std::fs::remove_dir_all(tmp.path().join(user));
    }
    let out = beside_machine_policy(tmp.path(), machine, user_a, &laxer, &dir, &["policy"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        text.starts_with("policy /etc/torchtools/policy.toml: ")
            && text.contains("--time at most 1h")
            && text.contains(&format!(
                "TORCHTOOLS_POLICY={} is not read",
                laxer.display()
            )),
        "{text}"
    );
}

/// The vandal's flood (Debian's Python, which every user may run): 300 connections to
/// the server at `port` on loopback, each sending 2,000 pipelined `GET /` and never
/// reading an answer; says `ready` once all are open, and holds them until its
/// standard input closes.
const FLOOD: &str = r#"
import socket, sys
port = int(sys.argv[1])
ask = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 2000
held = []
for _ in range(300):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        try:
            s.send(ask)
        except OSError:
            pass
        held.append(s)
    except OSError:
        pass
print("ready", flush=True)
sys.stdin.read()
"#;

/// `curl`'s status for `url` as `user` with `Host: host`, giving up after 60 s
/// (`000`: no answer).
fn status_as(user: &str, url: &str, host: &str) -> String {
    let out = Command::new("runuser")
        .args([
            "-u",
            user,
            "--",
            "curl",
            "-s",
            "-m",
            "60",
            "-o",
            "/dev/null",
        ])
        .args(["-w", "%{http_code}", "-H"])
        .arg(format!("Host: {host}"))
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `serve` as an ordinary user stays up for the others while the vandal holds 300
/// connections that never read their answers (each client has at most its share of
/// the slots, and a connection ends after its lifetime), and answers only requests for
/// its own names: a page that rebinds another name to its address reads nothing.
#[test]
fn a_client_that_never_reads_holds_no_one_out_and_other_names_get_nothing() {
    let Some((tmp, dir)) = shared_machine() else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let home_a = home_of(tmp.path(), user_a);
    let mut server = as_user(user_a, &dir, &home_a)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--host",
            "gpu1.lab.example",
        ])
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let _groups = Groups(vec![server.id()]);
    let mut line = String::new();
    BufReader::new(server.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line
        .trim()
        .strip_prefix("torchtools: serving the page at http://127.0.0.1:")
        .and_then(|rest| rest.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    let url = format!("http://127.0.0.1:{port}/api/state");
    assert_eq!(status_as(user_b, &url, "127.0.0.1"), "200");

    let mut flood = Command::new("runuser")
        .args(["-u", "nobody", "--", "/usr/bin/python3", "-c", FLOOD])
        .arg(port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let _flood_group = Groups(vec![flood.id()]);
    let mut said = String::new();
    BufReader::new(flood.stdout.take().unwrap())
        .read_line(&mut said)
        .unwrap();
    assert_eq!(said.trim(), "ready");
    // Another user's request, while the flood holds its connections: answered.
    assert_eq!(status_as(user_b, &url, "127.0.0.1"), "200");
    assert_eq!(status_as(user_b, &url, &format!("localhost:{port}")), "200");
    assert_eq!(status_as(user_b, &url, "gpu1.lab.example"), "200");
    // A name that is not this server's (a page rebinding its own name): refused.
    assert_eq!(
        status_as(user_b, &url, &format!("attacker.example:{port}")),
        "421"
    );
    drop(flood.stdin.take());
    let _ = flood.wait();
    // SAFETY: kill(2) of the server's process group, which this test started.
    unsafe { libc::kill(-(server.id() as i32), libc::SIGKILL) };
    let _ = server.wait();
}

/// A request that could not run even once a preemptible job yields (it also wants a GPU
/// held by a job that is not preemptible) preempts nobody: root's preemptible job on
/// GPU 0 runs on while tt-test-a's request for GPUs 0 and 3 waits past the policy's
/// `after` and runs out, and GPU 0 never sits idle for it.
#[test]
fn a_request_that_cannot_then_be_served_preempts_nobody() {
    let Some((tmp, dir, policy)) = under_policy(
        "[fair_share]\nhalf_life = \"1h\"\n[preemption]\nafter = \"1s\"\ngrace = \"60s\"\n",
    ) else {
        return;
    };
    let [user_a, _] = tt_testkit::users::USER_NAMES;
    // (The home `Stopped` stops root's jobs from.)
    let root_home = tmp.path().to_owned();
    let root = || {
        let mut c = torchtools(&dir);
        c.env("TORCHTOOLS_POLICY", &policy)
            .env("XDG_STATE_HOME", root_home.join("state"))
            .env("XDG_CONFIG_HOME", root_home.join("config"))
            .env_remove("TORCHTOOLS_JOB_ID");
        c
    };
    let detach = |args: &[&str]| {
        let id = ok(root()
            .args(["reserve", "--detach"])
            .args(args)
            .args(["--no-fence", "--", "sleep", "600"])
            .output()
            .unwrap())
        .trim()
        .to_owned();
        crate::common::Stopped(tmp.path(), id)
    };
    let preemptible = detach(&["--preemptible", "--gpu", "0"]);
    let steady = detach(&["--gpu", "3"]);
    let job = |id: &str| -> serde_json::Value {
        let all: serde_json::Value =
            serde_json::from_str(&ok(root().args(["jobs", "--json"]).output().unwrap())).unwrap();
        all.as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id)
            .cloned()
            .unwrap()
    };
    crate::common::until("both of root's jobs run", || {
        job(&preemptible.1)["state"] == "running" && job(&steady.1)["state"] == "running"
    });
    let home_a = home_of(tmp.path(), user_a);
    // Waits 8 s: past `after` for 7 s, 14 of the job's looks at the queue.
    let out = as_user(user_a, &dir, &home_a)
        .env("TORCHTOOLS_POLICY", &policy)
        .args([
            "reserve",
            "--gpu",
            "0,3",
            "--timeout",
            "8s",
            "--no-fence",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    let log = std::path::PathBuf::from(job(&preemptible.1)["log"].as_str().unwrap());
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!said.contains("preempted"), "{said}");
    assert_eq!(job(&preemptible.1)["state"], "running");
}

/// A user whose processes ran under another policy (here `TORCHTOOLS_POLICY` naming no
/// file, on a machine without `/etc/torchtools/policy.toml`) and so hold more than the
/// machine's per-user limit is shown over it by every view another user reads, naming
/// the user and the processes; their records say they were made outside the machine's
/// policy, and `locks` and `metrics` say it.
#[test]
fn a_user_over_the_policys_limits_is_shown_by_every_view() {
    let Some((tmp, dir, policy)) = under_policy("[limits]\ngpus = 1\n") else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let home_b = home_of(tmp.path(), user_b);
    let mut groups = Groups(Vec::new());
    let mut children = Vec::new();
    for gpu in ["0", "1"] {
        let ready = home_b.join(format!("ready-{gpu}"));
        let child = as_user(user_b, &dir, &home_b)
            .env("TORCHTOOLS_POLICY", "/nonexistent/policy.toml")
            .args(["reserve", "--gpu", gpu, "--no-fence", "--", "sh", "-c"])
            .arg(format!("touch '{}'; exec sleep 600", ready.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        groups.0.push(child.id());
        children.push(child);
        crate::common::until("tt-test-b's reservation runs", || ready.exists());
    }
    let home_a = home_of(tmp.path(), user_a);
    let view = |args: &[&str]| -> String {
        let out = as_user(user_a, &dir, &home_a)
            .env("TORCHTOOLS_POLICY", &policy)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = format!("{user_b} holds 2 GPU(s), over the policy's limit of 1 (pids ");
    for args in [
        &["locks"][..],
        &["queue"],
        &["policy"],
        &["usage"],
        &["jobs", "--all"],
    ] {
        let out = view(args);
        assert!(
            out.contains(&format!("over the policy: {said}")),
            "{args:?}: {out}"
        );
    }
    let top: serde_json::Value = serde_json::from_str(&view(&["top", "--json"])).unwrap();
    let users = top["users"].as_array().unwrap();
    let b = users.iter().find(|u| u["user"] == user_b).unwrap();
    assert_eq!(
        b["over"], "holds 2 GPU(s), over the policy's limit of 1",
        "{top}"
    );
    assert_eq!(b["pids"].as_array().map(Vec::len), Some(2), "{top}");
    let metrics = view(&["metrics"]);
    assert!(
        metrics.contains(&format!(
            "torchtools_user_over_limit{{user=\"{user_b}\"}} 1"
        )),
        "{metrics}"
    );
    // Their records say the policy they were made under, and the views say it.
    let outside = "made outside the machine's policy (under /nonexistent/policy.toml)";
    let locks = view(&["locks"]);
    assert_eq!(locks.matches(outside).count(), 2, "{locks}");
    assert!(
        metrics.contains(&format!(
            "torchtools_requests_outside_policy{{user=\"{user_b}\"}} 2"
        )),
        "{metrics}"
    );
    drop(groups);
    for mut child in children {
        let _ = child.wait();
    }
}

/// What `shell` offers for the last of `words` (the word being completed), through the
/// script `COMPLETE=SHELL torchtools` prints, sourced by the real shell: bash calls the
/// function the script registers as `complete -F` would; fish answers `complete -C`
/// (its own non-interactive completion); zsh runs the script's completer with
/// `words`/`CURRENT` set as zsh's completion system sets them, `_describe` (which
/// needs a line editor to draw) printing what it would offer.
fn completes(shell: &str, dir: &Path, home: &Path, words: &[&str]) -> Vec<String> {
    let bin = env!("CARGO_BIN_EXE_torchtools");
    let quoted = words
        .iter()
        .map(|w| format!("'{w}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let (args, script) = match shell {
        "bash" => (
            vec!["--norc", "-c"],
            format!(
                "source <(COMPLETE=bash {bin})\n\
                 COMP_WORDS=({quoted}); COMP_CWORD={cword}; COMP_TYPE=9\n\
                 _clap_complete_torchtools torchtools \"${{COMP_WORDS[COMP_CWORD]}}\" \
                 \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
                 printf '%s\\n' \"${{COMPREPLY[@]}}\"",
                cword = words.len() - 1,
            ),
        ),
        "zsh" => (
            vec!["-f", "-c"],
            format!(
                "autoload -U compinit && compinit -u -D\n\
                 source <(COMPLETE=zsh {bin})\n\
                 _describe() {{ print -l -- \"${{(@P)${{@[-1]}}}}\" }}\n\
                 words=({quoted}); CURRENT={current}\n\
                 _clap_dynamic_completer_torchtools",
                current = words.len(),
            ),
        ),
        "fish" => (
            vec!["--no-config", "-c"],
            format!(
                "COMPLETE=fish {bin} | source\n\
                 complete -C {line}",
                line = shell_quote(&words.join(" ")),
            ),
        ),
        other => panic!("no completion test for {other}"),
    };
    let out = Command::new(shell)
        .args(args)
        .arg(&script)
        .env("TORCHTOOLS_LOCK_DIR", dir)
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .unwrap_or_else(|e| {
            panic!("{shell} is not installed ({e}): `cargo xtask setup` installs Debian's {shell}")
        });
    assert!(out.status.success(), "{shell}: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            l.split(|c: char| c.is_whitespace() || c == ':')
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .filter(|l| !l.is_empty())
        .collect()
}

/// `text` as one single-quoted shell word (fish and POSIX shells alike).
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// `torchtools stop <TAB>` in bash, zsh and fish offers the user's own jobs first (newest first),
/// then another user's, and `last`; a typed prefix narrows them; `--gpu <TAB>` offers
/// the machine's GPUs and `auto`.
#[test]
fn shells_complete_job_ids_own_first_and_gpus() {
    let Some((tmp, dir)) = shared_machine() else {
        return;
    };
    let [user_a, _] = tt_testkit::users::USER_NAMES;
    let root_home = tmp.path().join("root-home");
    let detach = |cmd: &mut Command, gpu: &str| -> String {
        let out = cmd
            .args([
                "reserve",
                "--detach",
                "--gpu",
                gpu,
                "--no-fence",
                "--",
                "sleep",
                "600",
            ])
            .output()
            .unwrap();
        ok(out).trim().to_owned()
    };
    let home_a = home_of(tmp.path(), user_a);
    let theirs = detach(&mut as_user(user_a, &dir, &home_a), "2");
    let root = || {
        let mut c = torchtools(&dir);
        c.env("XDG_STATE_HOME", root_home.join("state"))
            .env("XDG_CONFIG_HOME", root_home.join("config"));
        c
    };
    let older = detach(&mut root(), "0");
    // Ids are named after the second they started: the newer one a second later.
    let start = std::time::Instant::now();
    while older.split('-').next() == Some(&tt_device::now_unix_secs().to_string()) {
        assert!(start.elapsed() < crate::common::PATIENCE);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let newer = detach(&mut root(), "1");
    let stops =
        [&theirs, &older, &newer].map(|id| crate::common::Stopped(tmp.path(), id.to_string()));
    // Running, so that stopping them at the end stops their commands.
    crate::common::until("the three jobs run", || {
        let all = ok(root().args(["jobs", "--all", "--json"]).output().unwrap());
        let all: serde_json::Value = serde_json::from_str(&all).unwrap();
        all.as_array()
            .is_some_and(|a| a.iter().filter(|j| j["state"] == "running").count() == 3)
    });
    for shell in ["bash", "zsh", "fish"] {
        let complete = |words: &[&str]| completes(shell, &dir, &root_home, words);
        let offered = complete(&["torchtools", "stop", ""]);
        let ids: Vec<&str> = offered
            .iter()
            .map(String::as_str)
            .filter(|w| !w.starts_with('-'))
            .collect();
        assert_eq!(
            ids,
            [newer.as_str(), older.as_str(), theirs.as_str(), "last"],
            "{shell}: {offered:?}"
        );
        let prefix = &newer[..newer.len() - 2];
        let narrowed = complete(&["torchtools", "logs", prefix]);
        assert!(
            narrowed.contains(&newer) && !narrowed.contains(&"last".to_owned()),
            "{shell}: {narrowed:?}"
        );
        let after = complete(&["torchtools", "jobs", "wait", ""]);
        assert!(after.contains(&older), "{shell}: {after:?}");
        let gpus = complete(&["torchtools", "reserve", "--gpu", ""]);
        assert_eq!(gpus, ["0", "1", "2", "auto"], "{shell}: {gpus:?}");
        let listed = complete(&["torchtools", "reserve", "--gpu", "0,"]);
        assert!(listed.contains(&"0,1".to_owned()), "{shell}: {listed:?}");
    }
    // Root stops all three (another user's too: root may signal any process).
    drop(stops);
}

/// A holder killed holding its GPU counts until shortly after its last sign of life in
/// its own user's log: another user's log saying the GPU was taken a moment after it
/// began (or that user deleting their log) neither shortens nor lengthens it.
#[test]
fn a_lost_reservation_ends_by_its_own_users_log_whatever_another_writes() {
    let Some((tmp, dir)) = shared_machine() else {
        return;
    };
    let [a, b] = tt_testkit::users::two_users().unwrap();
    let [name_a, name_b] = tt_testkit::users::USER_NAMES;
    let home_a = home_of(tmp.path(), name_a);
    let home_b = home_of(tmp.path(), name_b);
    let mut held = holding_gpu_0(as_user(name_a, &dir, &home_a), &[]);
    // SAFETY: kill(2) of a process group this test started.
    unsafe { libc::kill(-(held.id() as i32), libc::SIGKILL) };
    let _ = held.wait();
    let log_a = std::fs::read_to_string(dir.join(format!("usage-{}.jsonl", a.uid))).unwrap();
    let start: serde_json::Value = serde_json::from_str(log_a.lines().next().unwrap()).unwrap();
    let (began, gpu) = (
        start["time"].as_f64().unwrap(),
        start["gpu"].as_str().unwrap(),
    );
    // b says the GPU was taken 10 ms after a took it, in b's own log.
    let forged = format!(
        "{{\"event\":\"start\",\"id\":\"forged\",\"user\":\"{}\",\"host\":\"h\",\"pid\":1,\
         \"gpu\":\"{gpu}\",\"bytes\":null,\"time\":{},\"command\":[]}}\n\
         {{\"event\":\"end\",\"id\":\"forged\",\"time\":{},\"status\":0}}",
        name_b,
        began + 0.01,
        began + 0.02
    );
    let out = shell_as(
        name_b,
        &dir,
        &format!("printf '%s\\n' '{forged}' >> usage-{}.jsonl", b.uid),
    );
    assert!(out.status.success(), "{out:?}");
    // Time for a's reservation to have lasted clearly longer than b's log says.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let seconds_of_a = || -> (f64, f64) {
        let before = tt_device::now_unix();
        let out = as_user(name_b, &dir, &home_b)
            .args(["usage", "--json"])
            .output()
            .unwrap();
        let rows: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
        let row = rows["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name_a)
            .cloned()
            .unwrap_or_else(|| panic!("{rows}"));
        assert_eq!(row["lost"], 1, "{rows}");
        (row["gpu_hours"].as_f64().unwrap() * 3600.0, before - began)
    };
    let (counted, at_least) = seconds_of_a();
    assert!(
        counted >= at_least - 0.01 && at_least >= 1.0,
        "a's lost reservation counted {counted} s, ended by b's log (a's began {at_least} s before the reading)"
    );
    // b deleting their log changes nothing of a's either.
    let out = shell_as(name_b, &dir, &format!("rm usage-{}.jsonl", b.uid));
    assert!(out.status.success(), "{out:?}");
    let (counted, at_least) = seconds_of_a();
    assert!(counted >= at_least - 0.01, "{counted} < {at_least}");
}

/// Under fair share a user's reservation summarizes their own usage log once it has
/// grown 128 KiB past its last summary (so that a process new to the log, another
/// user's first request, reads from there), and every view reads the same use after
/// it: a summary is neither a record nor damage.
/// `reservations` ended reservations of `user` over the day before now, as lines of
/// their usage log.
fn history_of(user: &str, reservations: u32) -> String {
    let now = tt_device::now_unix();
    (0..reservations)
        .map(|i| {
            let t = now - 86_400.0 + f64::from(i) * 86_000.0 / f64::from(reservations);
            format!(
                "{{\"event\":\"start\",\"id\":\"h/0/{i}/0/{i}\",\"user\":\"{user}\",\
                 \"host\":\"h\",\"pid\":{i},\"gpu\":\"index 0\",\"bytes\":null,\"time\":{t},\
                 \"command\":[\"python\",\"train.py\"]}}\n\
                 {{\"event\":\"end\",\"id\":\"h/0/{i}/0/{i}\",\"time\":{},\"status\":0}}\n",
                t + 20.0
            )
        })
        .collect()
}

/// Writes `text` into `path` as `user` would (their file, made by them), through a file
/// in `tmp`.
fn write_as(user: &str, text: &str, path: &Path, tmp: &Path) {
    let written = tmp.join(format!("{user}-written.jsonl"));
    std::fs::write(&written, text).unwrap();
    let out = Command::new("runuser")
        .args(["-u", user, "--", "sh", "-c", "cat \"$0\" >> \"$1\""])
        .arg(&written)
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Issue 76: one user's log grown past what readers read (a MiB past its last summary)
/// costs every other reader nothing but a search of its last MiB: it is not read, its
/// owner stands as the heaviest user in every view, and their own next request reads
/// it whole and summarizes it, after which everyone reads their use again.
#[test]
fn a_log_written_past_its_summary_is_charged_to_its_owner_until_their_next_request() {
    let Some((tmp, dir, policy)) = under_policy("[fair_share]\nhalf_life = \"1d\"\n") else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let [a, b] = tt_testkit::users::two_users().unwrap();
    let (home_a, home_b) = (home_of(tmp.path(), user_a), home_of(tmp.path(), user_b));
    let log = dir.join(format!("usage-{}.jsonl", a.uid));
    // 2 MiB written by A into A's own log, with no summary; a little use of B's.
    write_as(user_a, &history_of(user_a, 8000), &log, tmp.path());
    assert!(std::fs::metadata(&log).unwrap().len() > 3 << 19);
    let b_log = dir.join(format!("usage-{}.jsonl", b.uid));
    write_as(user_b, &history_of(user_b, 10), &b_log, tmp.path());
    // What B's `torchtools ARGS` prints, under the policy.
    let as_b = |args: &[&str]| {
        ok(as_user(user_b, &dir, &home_b)
            .env("TORCHTOOLS_POLICY", &policy)
            .args(args)
            .output()
            .unwrap())
    };
    let standing_of_a = || {
        let json: serde_json::Value = serde_json::from_str(&as_b(&["policy", "--json"])).unwrap();
        json["users"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["user"] == user_a)
            .cloned()
            .unwrap_or_else(|| panic!("no standing of {user_a}: {json}"))
    };
    let before = standing_of_a();
    assert_eq!(before["fraction"], 1.0, "{before}");
    let why = before["unread"]
        .as_str()
        .unwrap_or_else(|| panic!("{before}"));
    assert!(
        why.contains(&format!("usage-{}.jsonl not read", a.uid)),
        "{before}"
    );
    let text = as_b(&["policy"]);
    assert!(
        text.contains(&format!("not counted: {user_a}'s usage log")),
        "{text}"
    );
    let text = as_b(&["metrics"]);
    assert!(
        text.contains(&format!(
            "torchtools_user_usage_unread{{user=\"{user_a}\"}} 1"
        )),
        "{text}"
    );
    // `usage` does not read it either, and says so; B's use is counted.
    let usage_of_a = || {
        let json: serde_json::Value = serde_json::from_str(&as_b(&["usage", "--json"])).unwrap();
        let rows = json["rows"].as_array().unwrap().clone();
        let row = |user: &str| rows.iter().find(|r| r["name"] == user).cloned();
        assert!(row(user_b).is_some(), "{json}");
        (row(user_a), json["ignored"].to_string())
    };
    let (row, ignored) = usage_of_a();
    assert!(row.is_none(), "{row:?}");
    assert!(
        ignored.contains(&format!("usage-{}.jsonl", a.uid)) && ignored.contains("not read"),
        "{ignored}"
    );

    // A's own request reads it whole and summarizes it.
    let out = as_user(user_a, &dir, &home_a)
        .env("TORCHTOOLS_POLICY", &policy)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    ok(out);
    // Summarized for the fair share, and for `usage` (its totals).
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("{\"event\":\"summary\"").count(), 2);
    assert_eq!(text.matches("\"totals\":{").count(), 1);
    let after = standing_of_a();
    assert!(after.get("unread").is_none(), "{after}");
    // 8,000 reservations of 20 s over the last day (44.4 GPU-hours), decayed with a
    // day's half-life: between half and all of it (and the minute of the request).
    let used = after["use_gpu_s"].as_f64().unwrap();
    assert!(
        (0.5 * 8000.0 * 20.0..=8000.0 * 20.0 + 60.0).contains(&used),
        "{after}"
    );
    // And `usage` counts every reservation of A's again, the request's too.
    let (row, ignored) = usage_of_a();
    let row = row.unwrap_or_else(|| panic!("no row of {user_a}: {ignored}"));
    assert_eq!(row["reservations"], 8001, "{row}");
    assert_eq!(ignored, "[]");
}

#[test]
fn a_reservation_under_fair_share_summarizes_its_users_log_and_views_read_the_same() {
    let Some((tmp, dir, policy)) = under_policy("[fair_share]\nhalf_life = \"1d\"\n") else {
        return;
    };
    let [user_a, user_b] = tt_testkit::users::USER_NAMES;
    let [a, _] = tt_testkit::users::two_users().unwrap();
    let (home_a, home_b) = (home_of(tmp.path(), user_a), home_of(tmp.path(), user_b));
    // A's history, written by A into A's own log: 3,000 reservations over a day.
    let history = history_of(user_a, 3000);
    let log = dir.join(format!("usage-{}.jsonl", a.uid));
    write_as(user_a, &history, &log, tmp.path());
    let a_as_b_sees = || {
        let out = as_user(user_b, &dir, &home_b)
            .env("TORCHTOOLS_POLICY", &policy)
            .args(["usage", "--json"])
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
        assert_eq!(json["skipped"], serde_json::json!([]), "{json}");
        let row = json["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == user_a)
            .cloned()
            .unwrap_or_else(|| panic!("no row of {user_a}: {json}"));
        (
            row["reservations"].as_u64().unwrap(),
            row["gpu_hours"].as_f64().unwrap(),
        )
    };
    let before = a_as_b_sees();
    assert_eq!(before.0, 3000);

    let out = as_user(user_a, &dir, &home_a)
        .env("TORCHTOOLS_POLICY", &policy)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    ok(out);
    let text = std::fs::read_to_string(&log).unwrap();
    let at = text
        .find("{\"event\":\"summary\"")
        .unwrap_or_else(|| panic!("no summary in A's log of {} bytes", text.len()));
    let summary: serde_json::Value =
        serde_json::from_str(text[at..].lines().next().unwrap()).unwrap();
    assert_eq!(summary["upto"], at, "a summary says where it starts");
    assert_eq!(summary["half_life"], 86_400.0);

    let after = a_as_b_sees();
    assert_eq!(after.0, before.0 + 1, "the reservation, once");
    assert!(
        (after.1 - before.1).abs() < 0.01,
        "A's use read the same around the summary: {before:?} then {after:?}"
    );
}
