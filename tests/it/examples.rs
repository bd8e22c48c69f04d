//! The `train` example as users run it: alone, then as two ranks under the launcher
//! `torchtools launch` uses, with checkpoints.

use std::path::Path;
use std::process::Command;

#[test]
fn the_train_example_runs_alone_and_under_the_launcher() {
    let example = train_example();
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let out = Command::new(&example)
        .env("TORCHTOOLS_TRAIN_EPOCHS", "1")
        .env("TORCHTOOLS_DEVICE", "cpu")
        .env("TORCHTOOLS_TRAIN_LOGDIR", logs.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("finished: 64 steps"),
        "alone: {} {said}",
        out.status
    );
    // The log directory: metrics (a line per log step and evaluation: 64 steps, every
    // 20, and the last), the loss curve, a TensorBoard event file.
    let metrics = std::fs::read_to_string(logs.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3 + 4, "{metrics}");
    let svg = std::fs::read_to_string(logs.path().join("loss.svg")).unwrap();
    assert!(
        svg.contains("class=\"loss\"") && svg.contains("class=\"eval\""),
        "{svg}"
    );
    let events = std::fs::read_dir(logs.path()).unwrap().flatten();
    let events: Vec<_> = events
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(events.len(), 1, "one TensorBoard event file");
    // A precision it does not know: refused before training, naming the choices.
    let out = Command::new(&example)
        .env("TORCHTOOLS_TRAIN_PRECISION", "fp8")
        .env("TORCHTOOLS_DEVICE", "cpu")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1) && err.contains("\"fp8\": use full, bf16 or fp16"),
        "{err}"
    );
    // Two ranks through the launcher `torchtools launch` uses, with checkpoints.
    // The ranks' variables through `env` (the launcher passes its own environment on;
    // this process's is shared with the other tests of its binary).
    let mut ranks_run = vec![
        "TORCHTOOLS_TRAIN_EPOCHS=1".into(),
        "TORCHTOOLS_DEVICE=cpu".into(),
    ];
    let mut ckpt = std::ffi::OsString::from("TORCHTOOLS_TRAIN_CKPT=");
    ckpt.push(dir.path());
    ranks_run.extend([ckpt, example.clone().into_os_string()]);
    let outcome = torchtools::dist::launch(&torchtools::dist::LaunchConfig::local(
        2,
        std::ffi::OsStr::new("/usr/bin/env"),
        ranks_run,
    ))
    .unwrap();
    assert_eq!(outcome.code, 0, "launched: {outcome:?}");
    // 2048 samples / (2 ranks x 32) = 32 steps; the last checkpoint is step 32.
    let latest = std::fs::read_to_string(dir.path().join("latest")).unwrap();
    assert!(latest.contains("00000032"), "latest checkpoint: {latest}");

    // One process on the two ranks' checkpoint: refused, naming both sizes.
    let alone = |ckpt: &Path, epochs: &str| {
        Command::new(&example)
            .env("TORCHTOOLS_TRAIN_EPOCHS", epochs)
            .env("TORCHTOOLS_TRAIN_CKPT", ckpt)
            .env("TORCHTOOLS_DEVICE", "cpu")
            .env_remove("TORCHTOOLS_LOG")
            .output()
            .unwrap()
    };
    let out = alone(dir.path(), "2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("run of 2 process(es)") && err.contains("has 1"),
        "{err}"
    );

    // Alone from the start, then one more epoch: the resume is visible in the logs
    // (torchtools::init_logging, info by default).
    let own = tempfile::tempdir().unwrap();
    assert!(alone(own.path(), "1").status.success());
    let out = alone(own.path(), "2");
    let err = String::from_utf8_lossy(&out.stderr);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resumed from"), "{err}");
    assert!(
        said.contains("finished: 128 steps (resumed from step 64)"),
        "{said}"
    );
}

/// The `train` example (cargo test builds the examples: target/debug/deps/examples-<hash>
/// -> target/debug/examples/train).
fn train_example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples/train");
    assert!(example.exists(), "{} was not built", example.display());
    example
}

/// An example binary (cargo test builds the examples), in a scratch directory, with
/// the CPU chosen unless the test says otherwise.
fn example(name: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(path.exists(), "{} was not built", path.display());
    let mut cmd = Command::new(path);
    cmd.current_dir(std::env::temp_dir())
        .env("TORCHTOOLS_DEVICE", "cpu")
        .env_remove("TORCHTOOLS_LOG");
    cmd
}

/// Runs it; fails the test when it fails; returns its stdout.
fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn device_from_env_follows_the_variables_and_refuses_a_missing_device() {
    let said = run_ok(&mut example("device_from_env"));
    assert!(
        said.contains("selected Cpu; a tensor there sums to 3"),
        "{said}"
    );
    assert!(said.contains("TORCHTOOLS_DEVICE=\"cpu\""), "{said}");
    let out = example("device_from_env")
        .env("TORCHTOOLS_DEVICE", "cuda:9")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TORCHTOOLS_DEVICE=\"cuda:9\""), "{err}");
}

#[test]
fn reserve_gpu_holds_the_lock_with_its_record_then_releases_it() {
    let locks = tempfile::tempdir().unwrap();
    let mut cmd = example("reserve_gpu");
    cmd.args(["0", "--no-fence"])
        .env("TORCHTOOLS_LOCK_DIR", locks.path())
        .env_remove("CUDA_VISIBLE_DEVICES");
    let said = run_ok(&mut cmd);
    assert!(said.contains("reserved GPU "), "{said}");
    assert!(
        said.contains(": held by pid ") && said.contains("reserving 2.00 GiB"),
        "{said}"
    );
    assert!(said.trim_end().ends_with("released"), "{said}");
    let dir = torchtools::lock::LockDir::open(locks.path()).unwrap();
    assert!(dir.list().unwrap().iter().all(|s| !s.held));
}

#[test]
fn probe_reserve_train_probes_then_trains() {
    let locks = tempfile::tempdir().unwrap();
    let said = run_ok(example("probe_reserve_train").env("TORCHTOOLS_LOCK_DIR", locks.path()));
    assert!(said.contains("plan: "), "{said}");
    assert!(said.contains("probe on cpu"), "the probe ran: {said}");
    assert!(said.contains("trained 100 steps: loss "), "{said}");
}

#[test]
fn adaptive_inference_runs_out_of_memory_then_fits() {
    let said = run_ok(&mut example("adaptive_inference"));
    let tried = said
        .lines()
        .find_map(|l| l.strip_prefix("batch sizes tried: "))
        .unwrap_or_else(|| panic!("{said}"));
    assert!(
        tried.starts_with("[16384, "),
        "the first size ran out of memory: {said}"
    );
    assert!(
        said.contains("largest difference from small batches"),
        "{said}"
    );
}

#[test]
fn adaptive_chunked_shrinks_its_chunks_and_computes_the_same() {
    let said = run_ok(&mut example("adaptive_chunked"));
    assert!(said.contains("first tried 8192 rows, then [4096"), "{said}");
    assert!(
        said.contains("largest difference on checked rows"),
        "{said}"
    );
}

#[test]
fn track_reports_a_function_with_its_blocks_and_a_command() {
    let said = run_ok(&mut example("track"));
    assert!(said.contains("== a function of this process"), "{said}");
    assert!(said.contains("Block \"load\": 1 call(s)"), "{said}");
    assert!(said.contains("Block \"compute\": 1 call(s)"), "{said}");
    assert!(said.contains("== a command (exit status: 0)"), "{said}");
    assert!(said.contains("Max RAM:"), "{said}");
}

#[test]
fn checkpoint_resume_after_kill_9_ends_as_an_uninterrupted_run() {
    use std::io::{BufRead, BufReader};
    let checksum = |said: &str| {
        said.lines()
            .find_map(|l| {
                l.split_once("parameters checksum ")
                    .map(|(_, c)| c.to_owned())
            })
            .unwrap_or_else(|| panic!("no checksum: {said}"))
    };
    let whole = tempfile::tempdir().unwrap();
    let uninterrupted = run_ok(example("checkpoint_resume").arg(whole.path()));
    assert!(
        uninterrupted.contains("finished 96 steps"),
        "{uninterrupted}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut child = example("checkpoint_resume")
        .arg(dir.path())
        .args(["--wait-after", "50"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The event: it says it waits after step 50 (it saved step 50 before).
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let waiting = line.starts_with("waiting after step 50");
        seen.push(line);
        if waiting {
            break;
        }
    }
    assert!(seen.iter().any(|l| l == "saved step 50"), "{seen:?}");
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let resumed = run_ok(example("checkpoint_resume").arg(dir.path()));
    assert!(resumed.contains("resumed at step 50"), "{resumed}");
    assert!(resumed.contains("finished 96 steps"), "{resumed}");
    assert_eq!(checksum(&resumed), checksum(&uninterrupted));
}

/// The train example as a job of two nodes (one rank each, on this host): `kill -9` of
/// node 1's rank mid-training ends node 0's launcher too, naming node 1's rank; the
/// same two commands again resume from the checkpoint on both nodes and end with the
/// parameters of an uninterrupted run, bit for bit.
#[test]
fn a_two_node_train_job_survives_kill_9_of_a_rank_and_resumes_exactly() {
    use torchtools::dist::{free_port, launch, LaunchConfig, LaunchOutcome};
    let example = train_example();
    let node = |rank: usize, port: u16, ckpt: &Path| {
        let mut cfg = LaunchConfig::local(1, example.as_os_str(), Vec::new());
        cfg.nnodes = 2;
        cfg.node_rank = rank;
        cfg.master_port = Some(port);
        cfg.env = [
            ("TORCHTOOLS_TRAIN_EPOCHS", "20".as_ref()),
            ("TORCHTOOLS_DEVICE", "cpu".as_ref()),
            ("TORCHTOOLS_TRAIN_CKPT", ckpt.as_os_str()),
            ("TORCHTOOLS_DIST_TIMEOUT", "300".as_ref()),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.to_owned()))
        .collect();
        cfg
    };
    let job = |ckpt: &Path, during: &dyn Fn()| -> Vec<LaunchOutcome> {
        let port = free_port("127.0.0.1").unwrap();
        let nodes: Vec<_> = (0..2)
            .map(|rank| {
                let cfg = node(rank, port, ckpt);
                std::thread::spawn(move || launch(&cfg).unwrap())
            })
            .collect();
        during();
        nodes.into_iter().map(|n| n.join().unwrap()).collect()
    };
    let parameters = |ckpt: &Path| final_parameters(ckpt, 640); // 20 epochs of 32 steps

    let whole = tempfile::tempdir().unwrap();
    for outcome in job(whole.path(), &|| {}) {
        assert_eq!(outcome.code, 0, "{outcome:?}");
    }

    let dir = tempfile::tempdir().unwrap();
    let me = std::process::id();
    let kill_node_1s_rank = || {
        // The event: rank 0 has written the checkpoint of step 20 (of 640).
        let latest = dir.path().join("latest");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
        while !std::fs::read_to_string(&latest).is_ok_and(|l| !l.contains("00000000")) {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint was written"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Node 1's rank: our child whose variables say GROUP_RANK=1.
        let rank = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .find(|pid| {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status"));
                let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                status.is_ok_and(|s| s.contains(&format!("\nPPid:\t{me}\n")))
                    && env.split(|b| *b == 0).any(|v| v == b"GROUP_RANK=1")
            })
            .expect("node 1's rank is running");
        // SAFETY: kill(2) of a child of this process, found just above.
        unsafe { libc::kill(rank, libc::SIGKILL) };
    };
    let killed = job(dir.path(), &kill_node_1s_rank);
    for (node, outcome) in killed.iter().enumerate() {
        let (rank, how) = outcome.failed.clone().expect("the job failed");
        assert_eq!(outcome.code, 137, "node {node}: {outcome:?}");
        assert_eq!(rank, 1, "node {node}: {outcome:?}");
        assert!(
            how.contains("killed (SIGKILL) on node 1"),
            "node {node}: {how}"
        );
    }
    // Killed mid-training: a checkpoint there, the run not finished.
    let step = torchtools::ckpt::CheckpointDir::open(dir.path())
        .unwrap()
        .load_latest()
        .unwrap()
        .expect("a checkpoint")
        .checkpoint
        .step();
    assert!(step > 0 && step < 640, "killed at step {step}");
    for outcome in job(dir.path(), &|| {}) {
        assert_eq!(outcome.code, 0, "{outcome:?}");
    }
    assert_eq!(parameters(dir.path()), parameters(whole.path()));
}

/// The train example's parameters in the latest checkpoint of `ckpt`, which must be of
/// step `steps` (the end of its training).
fn final_parameters(ckpt: &Path, steps: u64) -> [Vec<u8>; 4] {
    let loaded = torchtools::ckpt::CheckpointDir::open(ckpt)
        .unwrap()
        .load_latest()
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(loaded.checkpoint.step(), steps);
    ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
        .map(|name| loaded.checkpoint.tensor(name).unwrap().data().to_vec())
}

/// The `torchtools` command of this workspace (built here if a test run has not built
/// it yet: cargo does not hold its build lock while tests run). With `--tests`, its
/// dependencies have the features of the CLI's own test build, so the command that
/// build made is used as it is: without, cargo built the CLI and half its dependencies
/// again inside this test (a minute and a half on 2 cores).
fn torchtools_command() -> std::path::PathBuf {
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "torchtools-cli",
            "--bin",
            "torchtools",
            "--tests",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "building the torchtools command failed");
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .and_then(Path::parent)
        .unwrap()
        .join("torchtools")
}

/// `torchtools stop` of a detached two-rank training job: the trainer checkpoints and
/// the job ends preempted (75); the same command run again resumes and finishes. The
/// detached run trains 20 steps and then waits for the stop (the example's
/// `TORCHTOOLS_TRAIN_STEPS_PER_RUN`), so the stop always finds it training.
#[test]
fn a_stopped_detached_training_job_checkpoints_and_resumes() {
    let example = train_example();
    let torchtools = torchtools_command();
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let tt = |args: &[&str]| {
        let mut c = Command::new(&torchtools);
        c.args(args)
            .env("TORCHTOOLS_LOCK_DIR", tmp.path().join("locks"))
            .env("XDG_STATE_HOME", tmp.path().join("state"))
            .env("TORCHTOOLS_TRAIN_EPOCHS", "3")
            .env("TORCHTOOLS_TRAIN_CKPT", &ckpt)
            .env("TORCHTOOLS_DEVICE", "cpu")
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .env_remove("TORCHTOOLS_TRAIN_STEPS_PER_RUN");
        c
    };
    let train = example.to_str().unwrap();
    let out = tt(&["launch", "--detach", "--nproc-per-node", "2", "--", train])
        .env("TORCHTOOLS_TRAIN_STEPS_PER_RUN", "20")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    // The event: the first checkpoint is written.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while !ckpt.join("latest").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint was written"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = tt(&["stop", &id, "--grace", "60s"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let jobs: serde_json::Value =
        serde_json::from_slice(&tt(&["jobs", "--json"]).output().unwrap().stdout).unwrap();
    let job = &jobs.as_array().unwrap()[0];
    let log = String::from_utf8(tt(&["logs", &id]).output().unwrap().stdout).unwrap();
    assert_eq!(job["status"], 75, "{job}\n{log}");
    assert!(log.contains("preempted after step"), "{log}");
    // The same command again (attached): it resumes and finishes.
    let out = tt(&["launch", "--nproc-per-node", "2", "--", train])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    // Stopped after step 20's checkpoint: at the end of step 20, or of step 21 where it waited.
    assert!(
        said.contains("finished: 96 steps (resumed from step 20)")
            || said.contains("finished: 96 steps (resumed from step 21)"),
        "{said}"
    );
}

/// The `train` example as a detached job with a time limit that requeues it
/// (`reserve --detach --requeue --time 3s`): cut again and again by SIGTERM (it
/// checkpoints and exits 75), run again from its checkpoint each time, it ends with the
/// parameters of an uninterrupted run, bit for bit. Each run trains at most 64 of the
/// 192 steps and then waits for its cut (`TORCHTOOLS_TRAIN_STEPS_PER_RUN`), so there
/// are at least 3 runs whatever the machine's speed.
#[test]
fn a_requeued_training_job_cut_by_its_time_limit_ends_as_an_uninterrupted_run() {
    let example = train_example();
    let torchtools = torchtools_command();
    let tmp = tempfile::tempdir().unwrap();
    let run = |ckpt: &Path| {
        let mut c = Command::new(&torchtools);
        c.env("TORCHTOOLS_LOCK_DIR", tmp.path().join("locks"))
            .env("XDG_STATE_HOME", tmp.path().join("state"))
            .env("TORCHTOOLS_TRAIN_EPOCHS", "3")
            .env("TORCHTOOLS_TRAIN_CKPT", ckpt)
            .env("TORCHTOOLS_DEVICE", "cpu")
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .env_remove("TORCHTOOLS_JOB_ID")
            .env_remove("TORCHTOOLS_TRAIN_STEPS_PER_RUN");
        c
    };
    let parameters = |ckpt: &Path| final_parameters(ckpt, 192); // 3 epochs of 64 steps
    let whole = tmp.path().join("whole");
    let out = run(&whole)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .arg(&example)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let cut = tmp.path().join("cut");
    let out = run(&cut)
        .args([
            "reserve",
            "--detach",
            "--requeue",
            "--time",
            "3s",
            "--gpu",
            "0",
        ])
        .args(["--no-fence", "--"])
        .arg(&example)
        .env("TORCHTOOLS_TRAIN_STEPS_PER_RUN", "64")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let job = || -> serde_json::Value {
        let out = run(&cut).args(["jobs", "--json"]).output().unwrap();
        let jobs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        jobs.as_array().unwrap()[0].clone()
    };
    // Bounded: a machine too slow to start the trainer within its limit would requeue
    // it for ever.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while job()["status"].is_null() {
        if std::time::Instant::now() > deadline {
            let _ = run(&cut).args(["stop", &id]).output();
            panic!("the job did not finish: {}", job());
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let log = String::from_utf8(run(&cut).args(["logs", &id]).output().unwrap().stdout).unwrap();
    let ended = job();
    let runs = ended["runs"].as_u64().unwrap();
    eprintln!("the job ran {runs} times");
    assert_eq!(ended["status"], 0, "{ended}\n{log}");
    assert!(runs >= 3, "cut fewer than twice: {ended}\n{log}");
    assert_eq!(
        log.matches("preempted after step").count() as u64,
        runs - 1,
        "{log}"
    );
    assert_eq!(parameters(&cut), parameters(&whole));
}
