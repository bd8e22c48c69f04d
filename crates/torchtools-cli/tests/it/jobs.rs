//! Detached runs as users run them: `--detach`, `jobs`, `logs -f`, `stop`, a terminal
//! that goes away, and jobs of another user.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::{detach, ok, tt, until};

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
    // A generous grace: on a busy machine the job must end by SIGTERM, never SIGKILL.
    let out = tt(dir)
        .args(["stop", &id, "--grace", "120s"])
        .output()
        .unwrap();
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
    // The job runs until the test says (after the terminal is gone), not for a time a
    // busy machine could outlast.
    let go = dir.join("go");
    let script = format!(
        "{} reserve --detach --gpu 0 --no-fence -- sh -c 'echo started; while [ ! -e {} ]; do sleep 0.05; done; echo finished' > {}; sleep 600",
        env!("CARGO_BIN_EXE_torchtools"),
        go.display(),
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
    // The keeper records the command's pid just after starting it: the command may
    // print before `jobs` can say "running".
    until("the job running", || job(dir, &id)["state"] == "running");
    let session = terminal.id() as i32;
    // SAFETY: kill(2) of the test's own child session group.
    unsafe {
        libc::kill(-session, libc::SIGHUP);
        libc::kill(-session, libc::SIGKILL);
    }
    terminal.wait().unwrap();
    assert_eq!(
        job(dir, &id)["state"],
        "running",
        "the job ended with its terminal"
    );
    std::fs::write(&go, "").unwrap();
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

/// A detached `reserve` that waits in the queue shows as waiting, then as running
/// with its GPU and bytes; a record from before a reboot shows as lost.
#[test]
fn jobs_show_waiting_running_and_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let locks = tt_lock::LockDir::open(dir.join("locks")).unwrap();
    let held = locks
        .lock(
            &crate::common::key0(),
            tt_lock::Wait::Try,
            tt_lock::Holder::current(),
        )
        .unwrap();
    let id = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--bytes",
            "1GiB",
            "--no-fence",
            "--",
            "sh",
            "-c",
            "echo got it; sleep 600",
        ],
    );
    until("the job waits for GPU 0", || {
        job(dir, &id)["state"] == "waiting"
    });
    drop(held);
    until("the job holds GPU 0", || {
        ok(tt(dir).args(["logs", &id]).output().unwrap()).contains("got it")
    });
    let running = job(dir, &id);
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(
        running["gpus"].as_array().map(Vec::len),
        Some(1),
        "{running}"
    );
    assert_eq!(running["bytes"], 1u64 << 30, "{running}");
    assert!(tt(dir)
        .args(["stop", &id, "--grace", "1s"])
        .output()
        .unwrap()
        .status
        .success());
    assert_ne!(job(dir, &id)["status"], serde_json::Value::Null);

    // A job whose record says another boot: the machine rebooted under it.
    let record = dir.join("locks").join(format!("job-{id}.json"));
    let mut j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    j["status"] = serde_json::Value::Null;
    j["boot_id"] = "another boot".into();
    std::fs::write(&record, serde_json::to_vec(&j).unwrap()).unwrap();
    assert_eq!(job(dir, &id)["state"], "lost (the machine rebooted)");
}

/// Two Unix users (root in CI, and `nobody` through `runuser`): each sees the other's
/// jobs with `--all`; nobody cannot stop root's job.
#[test]
fn another_users_jobs_are_listed_but_not_stopped() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path();
    let as_nobody = |args: &[&str]| {
        Command::new("runuser")
            .args(["-u", "nobody", "--", env!("CARGO_BIN_EXE_torchtools")])
            .args(args)
            .env("TORCHTOOLS_LOCK_DIR", dir.join("locks"))
            .env("XDG_STATE_HOME", dir.join("nobody-state"))
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let mine = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sleep",
            "600",
        ],
    );
    std::fs::create_dir(dir.join("nobody-state")).unwrap();
    std::fs::set_permissions(
        dir.join("nobody-state"),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let theirs = ok(as_nobody(&[
        "reserve",
        "--detach",
        "--gpu",
        "1",
        "--no-fence",
        "--",
        "sleep",
        "600",
    ]))
    .trim()
    .to_owned();
    // Each sees both with --all, only their own without.
    let listed = ok(as_nobody(&["jobs", "--all"]));
    assert!(
        listed.contains(&mine) && listed.contains(&theirs),
        "{listed}"
    );
    assert!(!ok(as_nobody(&["jobs"])).contains(&mine));
    // nobody cannot stop root's job...
    let out = as_nobody(&["stop", &mine]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("belongs to root"),
        "{out:?}"
    );
    assert_eq!(job(dir, &mine)["state"], "running");
    // Another user's job may be waited for (as the README says: records are readable
    // by all): root's job after nobody's waits until it has ended.
    let after = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--after",
            &theirs,
            "--gpu",
            "2",
            "--no-fence",
            "--",
            "true",
        ],
    );
    crate::common::until("it waits for nobody's job", || {
        job(dir, &after)["state"] == format!("waiting for job {theirs}")
    });
    // ...root can stop both.
    for id in [&mine, &theirs] {
        assert!(tt(dir)
            .args(["stop", id, "--grace", "1s"])
            .output()
            .unwrap()
            .status
            .success());
        assert_ne!(job(dir, id)["status"], serde_json::Value::Null, "{id}");
    }
    // nobody's job ended (stopped): the job after it ran.
    let out = tt(dir).args(["jobs", "wait", &after]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// The hang-up: a detached two-rank `launch` of a PyTorch DDP script, started
/// in a terminal (a pseudo-terminal from `script`) whose session is then hung up and
/// killed: both ranks finish, the job's log holds both ranks' lines, and the trained
/// parameters are an attached run's, bit for bit.
#[test]
fn a_detached_launch_survives_its_terminal_and_trains_as_an_attached_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let script = dir.join("ddp.py");
    std::fs::write(
        &script,
        "import torch, torch.distributed as dist\n\
         dist.init_process_group('gloo')\n\
         torch.manual_seed(0)\n\
         model = torch.nn.Linear(8, 1)\n\
         ddp = torch.nn.parallel.DistributedDataParallel(model)\n\
         opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n\
         g = torch.Generator().manual_seed(1 + dist.get_rank())\n\
         for step in range(30):\n\
         \x20   loss = ddp(torch.randn(16, 8, generator=g)).pow(2).mean()\n\
         \x20   opt.zero_grad(); loss.backward(); opt.step()\n\
         print('rank', dist.get_rank(), 'done')\n\
         if dist.get_rank() == 0:\n\
         \x20   print('params', b''.join(p.detach().numpy().tobytes() for p in model.parameters()).hex())\n\
         dist.destroy_process_group()\n",
    )
    .unwrap();
    let python = tt_testkit::python_path();
    let launch = |extra: &[&str]| {
        let mut args: Vec<String> = vec!["launch".into(), "--nproc-per-node".into(), "2".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(["--".into(), python.clone(), script.display().to_string()]);
        args
    };
    let params = |log: &str| {
        log.lines()
            .find_map(|l| l.split_once("params ").map(|(_, p)| p.to_owned()))
            .unwrap_or_else(|| panic!("no parameters in {log}"))
    };
    let attached = ok(tt(dir)
        .args(launch(&[]))
        .env_remove("PYTHONUNBUFFERED")
        .output()
        .unwrap());

    let id_file = dir.join("id");
    let line = format!(
        "{} {} > {}; sleep 600",
        env!("CARGO_BIN_EXE_torchtools"),
        launch(&["--detach"]).join(" "),
        id_file.display()
    );
    let mut terminal = Command::new("script");
    terminal
        .args(["-qec", &line, "/dev/null"])
        .env("TORCHTOOLS_LOCK_DIR", dir.join("locks"))
        .env("XDG_STATE_HOME", dir.join("state"))
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .env_remove("PYTHONUNBUFFERED")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    let mut terminal = terminal.spawn().unwrap();
    until("the job's id", || {
        std::fs::read_to_string(&id_file).is_ok_and(|s| !s.trim().is_empty())
    });
    let id = std::fs::read_to_string(&id_file).unwrap().trim().to_owned();
    // The terminal goes away: its session is hung up, then everything in it killed.
    let group = terminal.id() as i32;
    // SAFETY: kill(2) of the test's own child process group.
    unsafe {
        libc::kill(-group, libc::SIGHUP);
        libc::kill(-group, libc::SIGKILL);
    }
    terminal.wait().unwrap();
    let log = ok(tt(dir).args(["logs", &id, "-f"]).output().unwrap());
    assert!(
        log.contains("[rank0]: rank 0 done") && log.contains("[rank1]: rank 1 done"),
        "{log}"
    );
    assert_eq!(job(dir, &id)["status"], 0, "{log}");
    assert_eq!(params(&log), params(&attached));
}

/// A job started on the host, seen from a container sharing the lock directory (a PID
/// namespace of its own): listed as started elsewhere (its keeper's pid means nothing
/// there), never as lost; `logs -f` there follows it to its end; `stop` there is refused,
/// naming where to stop it.
#[test]
fn a_job_seen_from_another_pid_namespace_is_not_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let go = dir.join("go");
    let Some(_) = crate::common::in_container(&dir.join("locks")) else {
        return;
    };
    let container = |args: &[&str]| {
        crate::common::in_container(&dir.join("locks"))
            .unwrap()
            .args(args)
            .env("XDG_STATE_HOME", dir.join("state"))
            .output()
            .unwrap()
    };
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
            &format!(
                "echo ready; while [ ! -e {} ]; do sleep 0.05; done; echo end",
                go.display()
            ),
        ],
    );
    until("the job runs", || {
        ok(tt(dir).args(["logs", &id]).output().unwrap()).contains("ready")
    });
    let seen: serde_json::Value =
        serde_json::from_str(&ok(container(&["jobs", "--json", "--all"]))).unwrap();
    assert_eq!(
        seen[0]["state"], "started in another PID namespace",
        "{seen}"
    );
    let out = container(&["stop", &id]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another PID namespace"),
        "{out:?}"
    );
    std::fs::write(&go, "").unwrap();
    let log = ok(container(&["logs", &id, "-f"]));
    assert!(log.contains("end"), "followed to its end: {log}");
    assert_eq!(job(dir, &id)["status"], 0);
}

/// Job records trust their file's owner: a record another user wrote claiming root is
/// not listed but said, a record that is not one is listed as damaged, and a `jobs`
/// symbolic link planted in the lock directory is never followed.
#[test]
fn forged_and_damaged_job_records_are_said_and_a_planted_symlink_is_not_followed() {
    let Some(tmp) = crate::common::shared_dir_for_two_users() else {
        return;
    };
    let dir = tmp.path();
    let mine = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ],
    );
    until("the job ended", || job(dir, &mine)["status"] == 0);
    let locks = dir.join("locks");
    std::os::unix::fs::symlink("/etc", locks.join("jobs")).unwrap();
    // nobody copies root's record under a new id, and writes a damaged one.
    let mine_record = std::fs::read_to_string(locks.join(format!("job-{mine}.json"))).unwrap();
    let forged = mine_record.replace(&mine, "forged1");
    let script = format!(
        "printf '%s' \"$1\" > {0}/job-forged1.json && printf '{{\"id\":' > {0}/job-cut.json",
        locks.display()
    );
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--", "sh", "-c", &script, "sh", &forged])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listed = ok(tt(dir).args(["jobs", "--all"]).output().unwrap());
    assert!(listed.contains(&mine), "{listed}");
    assert!(
        listed.contains("1 record ignored:")
            && listed.contains("job-forged1.json: written by uid 65534 (nobody), claims root"),
        "{listed}"
    );
    assert!(
        listed.contains("damaged job record") && listed.contains("job-cut.json"),
        "{listed}"
    );
    let json: serde_json::Value = serde_json::from_str(&ok(tt(dir)
        .args(["jobs", "--json", "--all"])
        .output()
        .unwrap()))
    .unwrap();
    assert_eq!(json.as_array().map(Vec::len), Some(1), "{json}");
    // The forged id is no job to stop.
    let out = tt(dir).args(["stop", "forged1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(std::fs::symlink_metadata(locks.join("jobs"))
        .unwrap()
        .is_symlink());
}

/// A script's own `--detach`, `--log-dir`, `--` and `=` forms reach it unchanged,
/// detached or not: `launch` takes the program without a `--` (torchrun's form), and
/// only the options before it are torchtools'.
#[test]
fn a_detached_launch_passes_the_programs_own_options_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let own = [
        "--log-dir",
        "out",
        "--detach",
        "x",
        "--",
        "--log-dir=y",
        "--detach=z",
    ];
    let launch = |detach: bool| {
        let mut args = vec!["launch"];
        if detach {
            args.extend(["--detach", "--log-dir", "logs"]);
        }
        args.extend([
            "--nproc-per-node",
            "1",
            "sh",
            "-c",
            "echo args: \"$*\"",
            "sh",
        ]);
        args.extend(own);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let expected = format!("[rank0]: args: {}", own.join(" "));
    let attached = ok(tt(dir)
        .current_dir(dir)
        .args(launch(false))
        .output()
        .unwrap());
    assert!(attached.contains(&expected), "{attached}");
    let id = ok(tt(dir)
        .current_dir(dir)
        .args(launch(true))
        .output()
        .unwrap())
    .trim()
    .to_owned();
    until("the detached launch ended", || {
        job(dir, &id)["status"] != serde_json::Value::Null
    });
    assert_eq!(job(dir, &id)["status"], 0);
    let log = ok(tt(dir).args(["logs", &id]).output().unwrap());
    assert!(log.contains(&expected), "{log}");
    assert!(dir.join("logs").join(format!("{id}.log")).is_file());
}

/// `--after` and `--after-ok` with real detached jobs: a chain of three runs in order
/// (each waits as "waiting for job ID" until the one before has ended), `--after-ok`
/// behind a failure is cancelled without running, a job whose keeper is killed with
/// `kill -9` counts as ended, and `jobs wait` returns the worst status.
#[test]
fn jobs_wait_for_jobs_and_jobs_wait_returns_the_worst_status() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let file = |name: &str| dir.join(name).display().to_string();
    let job_on = |gpu: &str, after: &[&str], script: &str| {
        let mut args = vec!["reserve", "--detach"];
        args.extend(after);
        args.extend(["--gpu", gpu, "--no-fence", "--", "sh", "-c", script]);
        detach(dir, &args)
    };
    let wait = |args: &[&str]| tt(dir).args(["jobs", "wait"]).args(args).output().unwrap();
    // A chain: a waits for a file, b after a, c after b; all on different GPUs, so
    // only the dependencies order them.
    let order = file("order");
    let a = job_on(
        "0",
        &[],
        &format!(
            "while [ ! -e {} ]; do sleep 0.05; done; echo a >> {order}",
            file("go")
        ),
    );
    let b = job_on("1", &["--after", &a], &format!("echo b >> {order}"));
    let c = job_on("2", &["--after", &b], &format!("echo c >> {order}"));
    until("b and c wait for their jobs", || {
        job(dir, &b)["state"] == format!("waiting for job {a}")
            && job(dir, &c)["state"] == format!("waiting for job {b}")
    });
    std::fs::write(file("go"), "").unwrap();
    let out = wait(&["--all-mine"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "a\nb\nc\n");

    // --after-ok behind a failure: cancelled, never run; the worst status is 3.
    let d = job_on("0", &[], "exit 3");
    let e = job_on(
        "1",
        &["--after-ok", &d],
        &format!("touch {}", file("e-ran")),
    );
    let out = wait(&[&e]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("cancelled: job {d} failed")),
        "{out:?}"
    );
    assert!(!dir.join("e-ran").exists(), "a cancelled job ran");
    assert_eq!(wait(&[&d, &e]).status.code(), Some(3));

    // A keeper killed with kill -9 (its whole session): its job counts as ended, and
    // the job after it runs.
    let f = job_on("2", &[], "sleep 600");
    let g = job_on("0", &["--after", &f], &format!("touch {}", file("g-ran")));
    until("f runs", || job(dir, &f)["state"] == "running");
    let keeper = job(dir, &f)["keeper_pid"].as_i64().unwrap() as i32;
    // SAFETY: kill(2) of the session (process group) our detached job leads.
    unsafe { libc::kill(-keeper, libc::SIGKILL) };
    let out = wait(&[&g]);
    assert_eq!(out.status.code(), Some(0), "{out:?}: {}", job(dir, &g));
    assert!(dir.join("g-ran").exists());

    // A job that does not exist cannot be waited for: refused before anything starts.
    let out = tt(dir)
        .args([
            "reserve",
            "--detach",
            "--after",
            "no-such-job",
            "--gpu",
            "0",
        ])
        .args(["--no-fence", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job \"no-such-job\""));
}

/// `--time`: the command gets SIGTERM at the limit and SIGKILL after `--grace`; one that
/// checkpoints and exits 75 ends so; a detached job so ended says `timeout`; a `--time`
/// past the policy's `time_max` is refused before anything starts; `stop` ends a
/// `--requeue`d job for good.
#[test]
fn a_time_limit_sends_sigterm_then_sigkill_and_a_job_so_ended_says_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let limited = |script: &str| {
        tt(dir)
            .args([
                "reserve",
                "--gpu",
                "0",
                "--no-fence",
                "--time",
                "1s",
                "--grace",
                "1s",
            ])
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap()
    };
    // Deaf to SIGTERM (ignored across its exec): SIGKILL after the grace.
    let out = limited("trap '' TERM; echo started; exec sleep 600");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "started\n");
    assert!(
        err.contains("time limit (1s) reached: SIGTERM sent to the command (SIGKILL in 1s)")
            && err.contains("still runs 1s after the time limit's SIGTERM: SIGKILL"),
        "{err}"
    );
    // One that checkpoints on SIGTERM and exits 75.
    let out = limited("trap 'echo checkpointed; exit 75' TERM; while :; do sleep 0.05; done");
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("checkpointed"));
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("SIGKILL\n"),
        "{out:?}"
    );
    // Detached: the job's state says how it ended.
    let id = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--time",
            "1s",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            "trap 'exit 75' TERM; while :; do sleep 0.05; done",
        ],
    );
    let out = tt(dir).args(["jobs", "wait", &id]).output().unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert_eq!(job(dir, &id)["state"], "timeout: preempted (75)");
    // Past the machine's time_max: refused, naming the policy, before anything runs.
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, "[limits]\ntime_max = \"1d\"\n").unwrap();
    let out = tt(dir)
        .env("TORCHTOOLS_POLICY", &policy)
        .args([
            "reserve",
            "--time",
            "2d",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "touch",
        ])
        .arg(dir.join("ran"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        err.contains("--time 2d is longer than the machine's policy allows"),
        "{err}"
    );
    assert!(!dir.join("ran").exists());
    // A --requeue job that exits 75 runs again, until `stop` ends it for good.
    let runs = dir.join("runs");
    let id = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--requeue",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            &format!(
                "echo run >> {}; trap 'exit 75' TERM; [ $TORCHTOOLS_JOB_RUN -ge 3 ] || exit 75; \
                 while :; do sleep 0.05; done",
                runs.display()
            ),
        ],
    );
    until("the job's third run", || {
        job(dir, &id)["state"] == "running (run 3)"
    });
    ok(tt(dir)
        .args(["stop", &id, "--grace", "120s"])
        .output()
        .unwrap());
    assert_eq!(job(dir, &id)["state"], "preempted (75) (run 3)");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\nrun\nrun\n");
}

/// `--array 0-5%2`: one job per index, each with its TORCHTOOLS_ARRAY_TASK_ID, never
/// more than two at once; `jobs wait` and `stop` take the array's id for every task and
/// `ID_N` for one; tasks not started yet are cancelled by a stop, never started.
#[test]
fn an_array_runs_one_job_per_index_at_most_k_at_once_and_stops_whole_or_by_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let trace = dir.join("trace");
    let go = dir.join("go");
    // Each task notes its start, waits for `go`, notes its end (launch runs it without
    // a GPU reservation, so that tasks may overlap: only the array's limit orders them).
    let script = format!(
        "echo + $TORCHTOOLS_ARRAY_TASK_ID >> {t}; while [ ! -e {go} ]; do sleep 0.05; done; \
         echo - $TORCHTOOLS_ARRAY_TASK_ID >> {t}",
        t = trace.display(),
        go = go.display()
    );
    let array = detach(
        dir,
        &[
            "launch",
            "--detach",
            "--array",
            "0-5%2",
            "--no-python",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    let read = || std::fs::read_to_string(&trace).unwrap_or_default();
    until("two tasks started", || read().lines().count() == 2);
    until("the other four wait for the first two", || {
        (2..6).all(|i| {
            job(dir, &format!("{array}_{i}"))["state"]
                .as_str()
                .is_some_and(|s| s.starts_with("waiting for job"))
        })
    });
    assert_eq!(
        read().lines().count(),
        2,
        "a third task started: {}",
        read()
    );
    std::fs::write(&go, "").unwrap();
    let out = tt(dir).args(["jobs", "wait", &array]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        6,
        "{out:?}"
    );
    let (mut running, mut most, mut seen) = (0i32, 0, Vec::new());
    for line in read().lines() {
        let (sign, index) = line.split_once(' ').unwrap();
        running += if sign == "+" { 1 } else { -1 };
        most = most.max(running);
        if sign == "+" {
            seen.push(index.parse::<u32>().unwrap());
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2, 3, 4, 5], "{}", read());
    assert_eq!(most, 2, "{}", read());
    // Stopped by index, then whole: one at a time (%1), each blocking until stopped.
    let array = detach(
        dir,
        &[
            "launch",
            "--detach",
            "--array",
            "0-2%1",
            "--no-python",
            "--",
            "sh",
            "-c",
            "exec sleep 600",
        ],
    );
    until("task 0 runs", || {
        job(dir, &format!("{array}_0"))["state"] == "running"
    });
    ok(tt(dir)
        .args(["stop", &format!("{array}_2")])
        .output()
        .unwrap());
    assert_eq!(
        job(dir, &format!("{array}_2"))["state"],
        "cancelled: stopped before it started"
    );
    assert_eq!(job(dir, &format!("{array}_0"))["state"], "running");
    ok(tt(dir).args(["stop", &array]).output().unwrap());
    assert_ne!(job(dir, &format!("{array}_0"))["state"], "running");
    assert_eq!(
        job(dir, &format!("{array}_1"))["state"],
        "cancelled: stopped before it started"
    );
}
