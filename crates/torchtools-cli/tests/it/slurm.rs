//! torchtools inside a real Slurm cluster (Debian's Slurm 22.05, started by the test
//! with fake GPUs: `tt_testkit::slurm`): Slurm's allocation bounds the GPUs reserved,
//! and every record names the Slurm job.

use std::path::Path;
use std::process::{Command, Output};

use tt_testkit::slurm::Cluster;

/// `program ARGS` against `cluster`, torchtools' lock and user directories under
/// `dir`, run from `dir`, with the variables of the job step's environment (Slurm
/// passes the caller's along).
fn slurm(cluster: &Cluster, dir: &Path, program: &str) -> Command {
    let mut c = cluster.command(program);
    c.current_dir(dir)
        .env("TORCHTOOLS_LOCK_DIR", dir.join("locks"))
        .env("XDG_STATE_HOME", dir.join("state"))
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env("TT", env!("CARGO_BIN_EXE_torchtools"))
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("TORCHTOOLS_HELD_LOCKS")
        .env_remove("TORCHTOOLS_JOB_ID");
    c
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `sbatch OPTIONS script` run to its end (`--wait`), its output in `dir/output` (Slurm's
/// `%A`/`%a` patterns allowed): the job's id, once it succeeded.
fn sbatch_wait(
    cluster: &Cluster,
    dir: &Path,
    options: &[&str],
    output: &str,
    script: &Path,
) -> String {
    let out = slurm(cluster, dir, "sbatch")
        .args(["--parsable", "--wait"])
        .args(options)
        .arg("--output")
        .arg(dir.join(output))
        .arg(script)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
    stdout.trim().split(';').next().unwrap().to_owned()
}

/// Under `srun --gres=gpu:2` (the step's GPUs: the node's 0 and 1), in an `sbatch`
/// script (the job's) and in each task of an array: a GPU outside the allocation is
/// refused before anything is taken (exit 2, naming the variable read), one inside is
/// reserved, and `torchtools locks` names the Slurm job holding it.
#[test]
fn inside_a_slurm_job_only_its_gpus_are_reserved_and_the_records_name_the_job() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();

    let out = slurm(&cluster, dir, "srun")
        .args(["--gres=gpu:2", "sh", "-c"])
        .arg("echo job=$SLURM_JOB_ID; exec \"$TT\" reserve --gpu 3 --no-fence -- true")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{stdout}{stderr}\n{}",
        cluster.logs()
    );
    let job = stdout.trim().strip_prefix("job=").unwrap().to_owned();
    assert!(
        stderr.contains(&format!(
            "not one of Slurm job {job}'s GPUs (SLURM_STEP_GPUS=0,1)"
        )),
        "{stderr}"
    );

    // `probe` keeps to the job's GPUs too: it runs on a GPU without reserving it.
    let out = slurm(&cluster, dir, "srun")
        .args(["--gres=gpu:2", "sh", "-c"])
        .arg(
            "\"$TT\" probe --gpu 3 -- true; echo refused=$?; \
             \"$TT\" probe --gpu 1 -- true >/dev/null; echo probed=$?",
        )
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        stdout.contains("refused=2") && stdout.contains("probed=0"),
        "{stdout}{stderr}"
    );
    assert!(
        stderr.contains("is not one of Slurm job") && stderr.contains("(SLURM_STEP_GPUS=0,1)"),
        "{stderr}"
    );

    let out = slurm(&cluster, dir, "srun")
        .args(["--gres=gpu:2", "sh", "-c"])
        .arg(
            "echo job=$SLURM_JOB_ID; \
             exec \"$TT\" reserve --gpu 1 --no-fence -- sh -c '\"$TT\" locks; \"$TT\" metrics'",
        )
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let job = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("job="))
        .unwrap();
    let held = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(held.contains(&format!("in Slurm job {job}")), "{held}");
    // The metrics name it too, for a dashboard of several servers.
    let reservation = stdout
        .lines()
        .find(|l| l.starts_with("torchtools_gpu_reservations{"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        reservation.contains(&format!("slurm_job=\"{job}\"")) && reservation.ends_with(" 1.0"),
        "{reservation}"
    );

    // A batch script: the job's GPUs (SLURM_JOB_GPUS), one GPU of the node's four.
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         \"$TT\" reserve --gpu 2 --no-fence -- true 2>&1; echo refused=$?\n\
         exec \"$TT\" reserve --gpu \"$SLURM_JOB_GPUS\" --no-fence -- \"$TT\" locks --json\n",
    )
    .unwrap();
    let job = sbatch_wait(&cluster, dir, &["--gres=gpu:1"], "batch.out", &script);
    let log = std::fs::read_to_string(dir.join("batch.out")).unwrap();
    assert!(
        log.contains("refused=2") && log.contains("(SLURM_JOB_GPUS=0)"),
        "{log}"
    );
    let json = &log[log.find("\n{").unwrap_or_else(|| panic!("{log}"))..];
    let locks: serde_json::Value = serde_json::from_str(json).unwrap();
    let holders: Vec<&serde_json::Value> = locks["locks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g.get("holder").filter(|h| !h.is_null()))
        .collect();
    assert_eq!(holders.len(), 1, "{json}");
    assert_eq!(holders[0]["slurm_job"], serde_json::json!(job), "{json}");

    // Each task of an array names itself as Slurm does: ARRAYJOB_TASK.
    let array = sbatch_wait(
        &cluster,
        dir,
        &["--array=0-1", "--gres=gpu:1"],
        "array-%A_%a.out",
        &script,
    );
    for task in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("array-{array}_{task}.out"))).unwrap();
        assert!(
            log.contains(&format!("\"slurm_job\": \"{array}_{task}\"")),
            "{log}"
        );
    }
}

/// A trainer as a Slurm user writes one: it checkpoints and exits 75 on Slurm's warning
/// signal (SIGUSR1), resumes from its checkpoint, and knows its run from
/// `SLURM_RESTART_COUNT`. On its first run, with `TT_WAIT=1`, it waits at step 20 for
/// the signal (so the test is driven by what the job says, not by time); with
/// `TT_EARLY=1` it waits before it handles the signal at all (as while importing).
const TRAIN: &str = r#"
import os, signal, sys, time
ckpt, out = (sys.argv[1:] + ["job.ckpt", "job.out"])[:2]
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
if run == 0 and os.environ.get("TT_EARLY") == "1":
    print("starting, no handler yet", flush=True)
    while True:
        time.sleep(0.05)
import torch
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = torch.randn(64, 8, generator=g)
target = data.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    print("resumed at step", step, "in run", run + 1, flush=True)
while step < 40:
    if step == 20 and run == 0 and os.environ.get("TT_WAIT") == "1":
        print("waiting for Slurm's signal at step", step, flush=True)
        while not stop:
            time.sleep(0.05)
    if stop:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        print("checkpointed on SIGUSR1 at step", step, flush=True)
        sys.exit(75)
    i = step % 8 * 8
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(data[i:i + 8]), target[i:i + 8]).backward()
    opt.step()
    step += 1
with open(out, "w") as f:
    f.write(b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex())
print("trained in run", run + 1, flush=True)
"#;

/// `sbatch --requeue` of `torchtools reserve --requeue -- python train.py`: Slurm's
/// warning signal (`scancel --signal=USR1 --full`, what `--signal=USR1@90` sends before
/// the time limit) reaches the trainer through torchtools, the trainer checkpoints and
/// exits 75, torchtools requeues the Slurm job (`scontrol requeue`), and Slurm's second
/// run (`SLURM_RESTART_COUNT=1`) resumes and ends with the parameters of an
/// uninterrupted run, bit for bit.
/// `track` inside a Slurm step (`srun -c 1 --gres=gpu:2`) measures against the job's
/// part of the node: one expected core (the hardware percentages' denominator) and the
/// step's GPUs, saying so in its report; `-n`/`--n-expected-cores` still wins.
#[test]
fn track_inside_a_slurm_job_measures_against_the_jobs_cpus_and_gpus() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let report = |extra: &str| -> serde_json::Value {
        let out = slurm(&cluster, dir, "srun")
            .args(["-c", "1", "--gres=gpu:2", "sh", "-c"])
            .arg(format!(
                "exec \"$TT\" track --format json {extra} -- sh -c 'echo job=$SLURM_JOB_ID >&2'"
            ))
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    let cores = std::thread::available_parallelism().unwrap().get() as u64;
    let inside = report("");
    let cpu = &inside["cpu_utilization"];
    assert_eq!(
        (
            cpu["n_expected_cores"].as_u64(),
            cpu["system_core_count"].as_u64()
        ),
        (Some(1), Some(cores)),
        "{inside}"
    );
    let warnings = inside["torchtools"]["warnings"].to_string();
    assert!(
        warnings.contains("inside Slurm job")
            && warnings.contains("SLURM_CPUS_PER_TASK=1")
            && warnings.contains("SLURM_STEP_GPUS=0,1"),
        "{warnings}"
    );
    let given = report("--n-expected-cores 2");
    assert_eq!(
        given["cpu_utilization"]["n_expected_cores"].as_u64(),
        Some(2),
        "{given}"
    );
}

#[test]
fn a_slurm_job_checkpoints_on_slurms_signal_requeues_itself_and_resumes_bit_for_bit() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let (job, log) = signalled_and_requeued(
        &cluster,
        ("TT_WAIT", "1"),
        "waiting for Slurm's signal at step 20",
    );
    for line in [
        "checkpointed on SIGUSR1 at step 20",
        &format!("requeuing Slurm job {job}, whose next run resumes (SLURM_RESTART_COUNT=1)"),
        &format!("Slurm job {job}, run 2 (SLURM_RESTART_COUNT=1)"),
        "resumed at step 20 in run 2",
        "trained in run 2",
    ] {
        assert!(log.contains(line), "no {line:?} in\n{log}");
    }
}

/// Slurm's warning before the trainer handles it (Python still importing): the trainer
/// dies of SIGUSR1 with no checkpoint, torchtools requeues the job all the same (the
/// time limit would end it), and the second run trains from the start to an
/// uninterrupted run's parameters.
#[test]
fn a_signal_before_the_first_checkpoint_requeues_the_job_to_start_over() {
    let Some(cluster) = Cluster::one_node(1) else {
        return;
    };
    let (job, log) =
        signalled_and_requeued(&cluster, ("TT_EARLY", "1"), "starting, no handler yet");
    assert!(
        log.contains(&format!(
            "the command died of SIGUSR1 (Slurm's warning) before it could checkpoint: \
             requeuing Slurm job {job}"
        )),
        "{log}"
    );
    assert!(log.contains("trained in run 2"), "{log}");
    assert!(!log.contains("resumed at step"), "{log}");
}

/// An `sbatch --requeue --array=0-1` of [`TRAIN`] whose task 1 alone gets Slurm's
/// warning: task 1 checkpoints and requeues itself alone (`scontrol requeue ID_1`, its
/// array task, not the array), task 0 runs once to its end, and both end with an
/// uninterrupted run's parameters.
#[test]
fn an_array_task_is_requeued_alone() {
    let Some(cluster) = Cluster::one_node(2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    reference(dir, "train.py", TRAIN);
    let python = tt_testkit::python_path();
    let script = dir.join("array.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         if [ \"$SLURM_ARRAY_TASK_ID\" = 1 ]; then export TT_WAIT=1; fi\n\
         exec \"$TT\" reserve --requeue --gpu \"$SLURM_JOB_GPUS\" --no-fence -- \
         \"$PY\" train.py \"job-$SLURM_ARRAY_TASK_ID.ckpt\" \"job-$SLURM_ARRAY_TASK_ID.out\"\n",
    )
    .unwrap();
    let out = slurm(&cluster, dir, "sbatch")
        .args([
            "--parsable",
            "--requeue",
            "--array=0-1",
            "--gres=gpu:1",
            "--open-mode=append",
        ])
        .arg("--output")
        .arg(dir.join("job-%a.log"))
        .arg(&script)
        .env("PY", &python)
        .env_remove("PYTHONUNBUFFERED")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
    let array = stdout.trim().to_owned();
    let task = format!("{array}_1");
    let log =
        |i: u32| std::fs::read_to_string(dir.join(format!("job-{i}.log"))).unwrap_or_default();
    crate::common::until("task 1 waits for Slurm's signal", || {
        log(1).contains("waiting for Slurm's signal at step 20")
    });
    signal_until_requeued_and_completed(&cluster, dir, &task, &["--full"], &|| log(1));
    let task_0 = || {
        let out = slurm(&cluster, dir, "scontrol")
            .args(["show", "job", &format!("{array}_0")])
            .output()
            .unwrap();
        text(&out).0
    };
    crate::common::until("task 0 completes", || {
        task_0().contains("JobState=COMPLETED")
    });
    assert!(
        task_0().contains("Restarts=0"),
        "task 0 ran once: {}",
        task_0()
    );
    assert!(
        log(1).contains(&format!(
            "requeuing Slurm job {task}, whose next run resumes"
        )),
        "{}",
        log(1)
    );
    assert!(log(0).contains("trained in run 1"), "{}", log(0));
    for i in 0..2 {
        assert_eq!(
            std::fs::read_to_string(dir.join(format!("job-{i}.out"))).unwrap(),
            std::fs::read_to_string(dir.join("ref.out")).unwrap(),
            "task {i}'s parameters differ from an uninterrupted run's"
        );
    }
}

/// Sends Slurm's warning (`scancel --signal=USR1 OPTIONS job`) and waits until Slurm
/// says the job COMPLETED after one requeue; a failed or cancelled job fails the test,
/// with its output (`log`).
fn signal_until_requeued_and_completed(
    cluster: &Cluster,
    dir: &Path,
    job: &str,
    options: &[&str],
    log: &dyn Fn() -> String,
) {
    let out = slurm(cluster, dir, "scancel")
        .arg("--signal=USR1")
        .args(options)
        .arg(job)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let state = || {
        let out = slurm(cluster, dir, "scontrol")
            .args(["show", "job", job])
            .output()
            .unwrap();
        text(&out).0
    };
    crate::common::until("the requeued job completes", || {
        let said = state();
        assert!(
            !said.contains("JobState=FAILED") && !said.contains("JobState=CANCELLED"),
            "{said}\n{}",
            log()
        );
        said.contains("JobState=COMPLETED")
    });
    let said = state();
    assert!(said.contains("Restarts=1"), "{said}");
}

/// The README's two lines to copy (its ```` ```sh slurm ```` block: an `sbatch` line
/// and a `torchtools run --slurm` line), run as they are written on the one-node
/// cluster, `python train.py` being [`TRAIN`] in the reference Python: each job,
/// signalled as at its time limit, checkpoints, is requeued once and ends with an
/// uninterrupted run's parameters, bit for bit.
#[test]
fn the_readmes_two_lines_checkpoint_and_requeue_on_slurm() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let lines: Vec<String> = crate::readme::all_readmes()
        .into_iter()
        .flat_map(|(_, text)| crate::readme::shell_blocks(&text))
        .filter(|(_, marker, _)| marker == "slurm")
        .flat_map(|(_, _, lines)| lines)
        .filter(|l| !l.trim().is_empty() && !l.trim().starts_with('#'))
        .collect();
    assert!(
        lines.len() == 2
            && lines[0].starts_with("sbatch ")
            && lines[1].starts_with("torchtools run --detach --slurm "),
        "the README's ```sh slurm block: {lines:?}"
    );
    for line in &lines {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        reference(dir, "train.py", TRAIN);
        // `python` and `torchtools` by name, as the README's user has them.
        let bin = dir.join("bin");
        std::fs::create_dir(&bin).unwrap();
        for (name, target) in [
            ("python", tt_testkit::python_path()),
            ("torchtools", env!("CARGO_BIN_EXE_torchtools").to_owned()),
        ] {
            let path = bin.join(name);
            std::fs::write(&path, format!("#!/bin/sh\nexec '{target}' \"$@\"\n")).unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = slurm(&cluster, dir, "bash")
            .args(["-c", line])
            .env("PATH", path)
            .env("TT_WAIT", "1")
            .env_remove("PYTHONUNBUFFERED")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(
            out.status.success(),
            "`{line}`: {stdout}{stderr}\n{}",
            cluster.logs()
        );
        // sbatch says "Submitted batch job 57"; torchtools prints 57.
        let job = stdout
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_owned();
        let output = match line.starts_with("sbatch ") {
            true => dir.join(format!("slurm-{job}.out")),
            false => dir.join(format!("state/torchtools/logs/slurm-{job}.out")),
        };
        let log = || std::fs::read_to_string(&output).unwrap_or_default();
        crate::common::until("the first run is ready for Slurm's signal", || {
            log().contains("waiting for Slurm's signal")
        });
        signal_until_requeued_and_completed(&cluster, dir, &job, &["--full"], &log);
        assert!(log().contains("trained in run 2"), "`{line}`: {}", log());
        assert_eq!(
            std::fs::read_to_string(dir.join("job.out")).unwrap(),
            std::fs::read_to_string(dir.join("ref.out")).unwrap(),
            "`{line}`: the requeued run's parameters differ from an uninterrupted run's"
        );
    }
}

/// `sbatch --requeue` of `torchtools reserve --requeue -- python train.py` ([`TRAIN`]
/// with `env`), signalled with `scancel --signal=USR1 --full` once its output has
/// `ready`: waits until Slurm says the job COMPLETED after one requeue, checks its
/// parameters against an uninterrupted run's, and returns the job's id and output.
fn signalled_and_requeued(cluster: &Cluster, env: (&str, &str), ready: &str) -> (String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    reference(dir, "train.py", TRAIN);
    let python = tt_testkit::python_path();
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         exec \"$TT\" reserve --requeue --gpu \"$SLURM_JOB_GPUS\" --no-fence -- \
         \"$PY\" train.py job.ckpt job.out\n",
    )
    .unwrap();
    let out = slurm(cluster, dir, "sbatch")
        .args([
            "--parsable",
            "--requeue",
            "--gres=gpu:1",
            "--open-mode=append",
        ])
        .arg("--output")
        .arg(dir.join("job.log"))
        .arg(&script)
        .env("PY", &python)
        .env(env.0, env.1)
        .env_remove("PYTHONUNBUFFERED")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
    let job = stdout.trim().to_owned();
    let log = || std::fs::read_to_string(dir.join("job.log")).unwrap_or_default();
    crate::common::until("the first run is ready for Slurm's signal", || {
        log().contains(ready)
    });
    signal_until_requeued_and_completed(cluster, dir, &job, &["--full"], &log);
    assert_eq!(
        std::fs::read_to_string(dir.join("job.out")).unwrap(),
        std::fs::read_to_string(dir.join("ref.out")).unwrap(),
        "the requeued run's parameters differ from an uninterrupted run's"
    );
    (job, log())
}

/// `reserve --detach --slurm`: the same command line submitted with `sbatch` (no script
/// written by the user): `--count 2` becomes two of the node's GPUs, reserved inside
/// the job and named by `locks`; an `--array` waiting `--after-ok` for it runs each
/// task after it; the output goes to `--log-dir`.
#[test]
fn the_same_command_line_submits_to_slurm() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let logs = dir.join("logs");
    let submit = |extra: &[&str]| -> String {
        let out = slurm(&cluster, dir, env!("CARGO_BIN_EXE_torchtools"))
            .args(["reserve", "--detach", "--slurm", "--log-dir"])
            .arg(&logs)
            .args(extra)
            .args(["--no-fence", "--", "sh", "-c"])
            .arg("echo gpus=$SLURM_JOB_GPUS; exec \"$TT\" locks")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
        stdout.trim().to_owned()
    };
    let first = submit(&["--count", "2", "--time", "10m"]);
    let array = submit(&["--array", "0-1", "--after-ok", &first]);
    let done = |job: &str| {
        let out = slurm(&cluster, dir, "scontrol")
            .args(["show", "job", job])
            .output()
            .unwrap();
        let said = text(&out).0;
        assert!(
            !said.contains("JobState=FAILED") && !said.contains("JobState=CANCELLED"),
            "{said}"
        );
        said.matches("JobState=COMPLETED").count()
    };
    crate::common::until("the job and both array tasks complete", || {
        done(&first) == 1 && done(&array) == 2
    });
    let log = std::fs::read_to_string(logs.join(format!("slurm-{first}.out"))).unwrap();
    assert!(log.contains("gpus=0,1"), "{log}");
    assert_eq!(
        log.matches(&format!("in Slurm job {first}")).count(),
        2,
        "{log}"
    );
    for task in 0..2 {
        let log = std::fs::read_to_string(logs.join(format!("slurm-{array}_{task}.out"))).unwrap();
        assert!(
            log.contains(&format!("in Slurm job {array}_{task}")),
            "{log}"
        );
    }
    // What Slurm cannot be asked for is refused, and nothing is submitted.
    let out = slurm(&cluster, dir, env!("CARGO_BIN_EXE_torchtools"))
        .args([
            "reserve",
            "--detach",
            "--slurm",
            "--gpu",
            "3",
            "--no-fence",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    let queue = slurm(&cluster, dir, "squeue")
        .args(["-h"])
        .output()
        .unwrap();
    assert_eq!(text(&queue).0.trim(), "", "{:?}", text(&queue));
}

/// `jobs`, `logs`, `jobs wait` and `stop` on Slurm's jobs (submitted with `--slurm`):
/// listed from Slurm with their state, their output followed until they end, waited
/// for with their exit status, and stopped with `scancel`, after which the
/// `--requeue`d job's torchtools does not put it back. An option Slurm rejects is
/// Slurm's error, shown, and nothing is submitted.
#[test]
fn slurms_jobs_are_listed_followed_waited_for_and_stopped() {
    let Some(cluster) = Cluster::one_node(4) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let tt = |args: &[&str]| {
        slurm(&cluster, dir, env!("CARGO_BIN_EXE_torchtools"))
            .args(args)
            .output()
            .unwrap()
    };
    let submit = |extra: &[&str], script: &str| -> String {
        let out = tt(&[
            &["reserve", "--detach", "--slurm"][..],
            extra,
            &["--no-fence", "--", "sh", "-c", script],
        ]
        .concat());
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
        stdout.trim().to_owned()
    };
    // Slurm's own refusal, shown; nothing submitted.
    let out = tt(&[
        "reserve",
        "--detach",
        "--slurm",
        "--count",
        "9",
        "--no-fence",
        "--",
        "true",
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stderr.contains("sbatch refused the job")
            && stderr.contains("Requested node configuration is not available"),
        "{stderr}"
    );
    let failing = submit(&[], "echo started; sleep 2; echo done; exit 3");
    let stopped = submit(
        &["--time", "10m", "--requeue"],
        "trap 'echo got TERM; exit 75' TERM; echo ready; while :; do sleep 0.1; done",
    );
    // Both listed, from Slurm.
    let (listed, _) = text(&tt(&["jobs"]));
    assert!(listed.contains("Slurm's jobs"), "{listed}");
    for id in [&failing, &stopped] {
        assert!(
            listed.lines().any(|l| l.starts_with(&format!("{id} "))),
            "{listed}"
        );
    }
    // Its output followed until it ends, then its status waited for.
    let out = tt(&["logs", "--follow", &failing]);
    let (log, stderr) = text(&out);
    assert!(out.status.success(), "{log}{stderr}");
    assert!(log.contains("started") && log.contains("done"), "{log}");
    let out = tt(&["jobs", "wait", &failing]);
    let (said, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(3), "{said}{stderr}");
    assert!(
        said.contains(&format!("{failing}  FAILED (exit 3)")),
        "{said}"
    );
    // Stopped with scancel once it runs; Slurm's KillWait is its grace.
    crate::common::until("the second job's output says ready", || {
        text(&tt(&["logs", &stopped])).0.contains("ready")
    });
    let out = tt(&["stop", &stopped, "--grace", "5s"]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(text(&out).1.contains("KillWait"), "{:?}", text(&out));
    let out = tt(&["stop", &stopped]);
    let (stdout, stderr) = text(&out);
    let show = text(
        &slurm(&cluster, dir, "scontrol")
            .args(["show", "job", &stopped])
            .output()
            .unwrap(),
    )
    .0;
    let log = format!(
        "{:?}\n{}",
        text(&tt(&["logs", &stopped])),
        std::fs::read_to_string(dir.join(format!("state/torchtools/logs/slurm-{stopped}.out")))
            .unwrap_or_default()
    );
    assert!(out.status.success(), "{stdout}{stderr}\n{show}\n{log}");
    assert!(
        stderr.contains(&format!("Slurm job {stopped} stopped (CANCELLED")),
        "{stderr}\n{show}\n{log}"
    );
    // Its torchtools saw the command exit 75 and did not requeue a stopped job.
    crate::common::until("the stopped job's torchtools says what it did", || {
        text(&tt(&["logs", &stopped])).0.contains("exited 75")
    });
    let (log, _) = text(&tt(&["logs", &stopped]));
    assert!(
        log.contains("got TERM") && log.contains("was stopped") && log.contains("not requeued"),
        "{log}"
    );
    let out = tt(&["jobs", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == stopped.as_str())
        .unwrap_or_else(|| panic!("{rows}"));
    assert_eq!(row["scheduler"], "slurm");
    assert_eq!(row["state"], "CANCELLED", "{row}");
    assert_eq!(row["restarts"], 0, "{row}");
    let show = slurm(&cluster, dir, "scontrol")
        .args(["show", "job", &stopped])
        .output()
        .unwrap();
    assert!(text(&show).0.contains("Restarts=0"), "{:?}", text(&show));
    let out = tt(&["jobs", "wait", &stopped]);
    assert_ne!(out.status.code(), Some(0), "{:?}", text(&out));
}

/// `[detach] to = "slurm"` in the user's config.toml: `--detach` submits to Slurm
/// without `--slurm` (its script shown with `--dry-run`), `--no-slurm` keeps a job in
/// torchtools' own queue, and a wrong value is refused, naming the file and what it
/// takes. No cluster is needed: nothing reaches `sbatch`.
#[test]
fn the_users_config_sends_detached_jobs_to_slurm() {
    use crate::common::tt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let config = dir.join("config/torchtools/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, "[detach]\nto = \"slurm\"\n").unwrap();
    let run = |args: &[&str]| tt(dir).args(args).output().unwrap();
    let out = run(&[
        "reserve",
        "--detach",
        "--dry-run",
        "--count",
        "2",
        "--no-fence",
        "--",
        "true",
    ]);
    let (script, stderr) = text(&out);
    assert!(out.status.success(), "{script}{stderr}");
    assert!(
        script.contains("#SBATCH --gres=gpu:2\n")
            && script.contains("reserve --no-fence --gpu \"$SLURM_JOB_GPUS\" -- true\n"),
        "{script}"
    );
    let out = run(&[
        "reserve",
        "--detach",
        "--no-slurm",
        "--dry-run",
        "--no-fence",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("--dry-run prints"),
        "{:?}",
        text(&out)
    );
    let id = crate::common::detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--no-slurm",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ],
    );
    let out = run(&["jobs", "wait", &id]);
    assert!(out.status.success(), "{:?}", text(&out));
    std::fs::write(&config, "[detach]\nto = \"slrum\"\n").unwrap();
    let out = run(&["reserve", "--detach", "--no-fence", "--", "true"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("config.toml") && stderr.contains("to = \"slurm\""),
        "{stderr}"
    );
}

/// A Slurm whose controller does not answer (the real `squeue`, which then exits 0
/// with no jobs and its errors in its JSON) is said by `jobs` and fails `jobs wait
/// --all-mine` and `jobs wait ID`, after torchtools' own jobs are listed and waited for.
#[test]
fn a_slurm_controller_that_does_not_answer_is_said_and_hides_no_job() {
    use crate::common::{detach, tt};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Port 1 on this machine: nothing listens, and squeue gives up at once.
    let conf = dir.join("slurm.conf");
    std::fs::write(
        &conf,
        "ClusterName=gone\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=1\n\
         NodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost Default=YES\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let mut c = tt(dir);
        c.env("SLURM_CONF", &conf).args(args);
        c.output().unwrap()
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
            "true",
        ],
    );
    let out = run(&["jobs", "wait", "--all-mine"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains(&format!("{id}  finished")), "{stdout}");
    assert!(
        stderr.contains("your Slurm jobs are not waited for")
            && stderr.contains("Failed while looking for jobs")
            && stderr.contains("scontrol ping"),
        "{stderr}"
    );
    let out = run(&["jobs"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(&id), "{stdout}");
    assert!(stderr.contains("Slurm's jobs are not shown"), "{stderr}");
    // A Slurm id while the controller is away: its error, not "Slurm does not know it".
    let out = run(&["jobs", "wait", "57"]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("scontrol ping"), "{stdout}{stderr}");
}

/// The machine's policy (`[detach] to = "slurm"`) sends `--detach` to Slurm, saying
/// so; the user's config.toml and `--no-slurm` say otherwise.
#[test]
fn the_machines_policy_sends_detached_jobs_to_slurm() {
    use crate::common::tt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let policy = dir.join("policy.toml");
    std::fs::write(&policy, "[detach]\nto = \"slurm\"\n").unwrap();
    let run = |args: &[&str]| {
        let mut c = tt(dir);
        c.env("TORCHTOOLS_POLICY", &policy).args(args);
        c.output().unwrap()
    };
    let dry = [
        "reserve",
        "--detach",
        "--dry-run",
        "--no-fence",
        "--",
        "true",
    ];
    let out = run(&dry);
    let (script, stderr) = text(&out);
    assert!(out.status.success(), "{script}{stderr}");
    assert!(script.contains("#SBATCH --gres=gpu:1\n"), "{script}");
    assert!(
        stderr.contains("policy.toml says") && stderr.contains("--no-slurm"),
        "{stderr}"
    );
    let policy_line = text(&run(&["policy"])).0;
    assert!(
        policy_line.contains("--detach submits to Slurm"),
        "{policy_line}"
    );
    // The user's own config is theirs to say.
    let config = dir.join("config/torchtools/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(&config, "[detach]\nto = \"torchtools\"\n").unwrap();
    let out = run(&dry);
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("--dry-run prints"),
        "{:?}",
        text(&out)
    );
    std::fs::remove_file(&config).unwrap();
    let mut no_slurm = dry.to_vec();
    no_slurm[1] = "--no-slurm";
    no_slurm.insert(1, "--detach");
    assert_eq!(run(&no_slurm).status.code(), Some(2));
}

/// A PyTorch DDP trainer of two batches a step, as [`TRAIN`] on two ranks: as ranks
/// (WORLD_SIZE 2), one batch each; as one process, both. It checkpoints (rank 0) and
/// exits 75 on Slurm's warning signal, resumes from `argv[1]`, and rank 0 (or the one
/// process) writes the parameters to `argv[2]`; each rank says which host it is on
/// (its `tt*` interfaces). With TT_WAIT=1 each rank waits at step 20 of its first run
/// for the signal. With HOLD=1 the ranks write their pids (`pid-RANK`: the rank's and
/// its launcher's) and all-reduce until stopped.
const DDP: &str = r#"
import os, signal, socket, sys, time, torch, torch.distributed as dist
ckpt, out = sys.argv[1], sys.argv[2]
run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
hosts = [n for _, n in socket.if_nameindex() if n.startswith("tt")]
print("rank", rank, "of", world, "on", ",".join(hosts), flush=True)
if os.environ.get("HOLD"):
    with open(f"pid-{rank}.tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.rename(f"pid-{rank}.tmp", f"pid-{rank}")
    t = torch.ones(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    print("rank", rank, "resumed at step", step, "in run", run + 1, flush=True)
net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
data = [torch.randn(40, 16, 8, generator=torch.Generator().manual_seed(1 + r)) for r in range(2)]
while step < 40:
    if step == 20 and run == 0 and os.environ.get("TT_WAIT") == "1":
        print("rank", rank, "waiting for Slurm's signal at step", step, flush=True)
        while not stop:
            time.sleep(0.05)
    if stop:
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
            print("checkpointed on SIGUSR1 at step", step, flush=True)
        if world > 1:
            dist.barrier()
        sys.exit(75)
    if world > 1:
        loss = net(data[rank][step]).pow(2).mean()
    else:
        loss = sum(net(d[step]).pow(2).mean() for d in data) / 2
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
if rank == 0:
    with open(out, "w") as f:
        f.write(b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex())
    print("trained in run", run + 1, flush=True)
if world > 1:
    dist.destroy_process_group()
"#;

/// `script` written to `dir/name` and run there once as one uninterrupted process (no
/// Slurm, no ranks, no signal): its parameters in `dir/ref.out`, what a job of it must
/// end with.
fn reference(dir: &Path, name: &str, script: &str) {
    std::fs::write(dir.join(name), script).unwrap();
    let out = Command::new(tt_testkit::python_path())
        .args([name, "ref.ckpt", "ref.out"])
        .current_dir(dir)
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("SLURM_RESTART_COUNT")
        .env_remove("TT_WAIT")
        .env_remove("TT_EARLY")
        .env_remove("HOLD")
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
}

/// `srun --nodes 2 --ntasks-per-node 1 torchtools launch ddp.py` on a cluster of two
/// nodes, each in a network namespace of its own: one launcher per node reads the
/// step's nodes from Slurm (no node option), the ranks meet with c10d across the two
/// hosts and train to the parameters of one process, bit for bit. Then the same step
/// with node 1's launcher and rank killed: node 0's launcher ends the step (srun
/// returns) instead of waiting.
#[test]
fn srun_runs_one_launcher_per_node_and_a_killed_node_ends_the_step() {
    let Some(cluster) = Cluster::two_nodes("sl", 1) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    reference(dir, "ddp.py", DDP);
    let python = tt_testkit::python_path();
    let srun = || {
        let mut c = slurm(&cluster, dir, "srun");
        c.args(["--nodes", "2", "--ntasks-per-node", "1"])
            .arg(env!("CARGO_BIN_EXE_torchtools"))
            .args(["launch", "--nproc-per-node", "1", "--"])
            .args([python.as_str(), "ddp.py", "job.ckpt", "job.out"])
            .env_remove("OMP_NUM_THREADS")
            .env_remove("MASTER_PORT");
        c
    };
    let out = srun().output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
    for (node, host) in ["a", "b"].iter().enumerate() {
        assert!(
            stdout.contains(&format!("[rank{node}]: rank {node} of 2 on ttsl{host}v")),
            "{stdout}"
        );
        assert!(
            stderr.contains(&format!("node {node} of 2 of Slurm's job step")),
            "{stderr}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("job.out")).unwrap(),
        std::fs::read_to_string(dir.join("ref.out")).unwrap(),
        "two nodes' parameters differ from one process's"
    );
    // Node 1 dies: its launcher and its rank, killed.
    let child = srun()
        .env("HOLD", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    crate::common::until("both ranks all-reduce", || {
        dir.join("pid-0").exists() && dir.join("pid-1").exists()
    });
    let pids = std::fs::read_to_string(dir.join("pid-1")).unwrap();
    for (i, pid) in pids.split_whitespace().enumerate() {
        let pid: i32 = pid.parse().unwrap();
        // The rank leads a process group of its own; its launcher is its parent.
        let target = if i == 0 { -pid } else { pid };
        // SAFETY: kill(2) of the test's own job's processes.
        assert_eq!(unsafe { libc::kill(target, libc::SIGKILL) }, 0, "{pid}");
    }
    let out = tt_testkit::hang::within(
        std::time::Duration::from_secs(300),
        "srun after node 1 was killed",
        move || child.wait_with_output().unwrap(),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("node 1") && stderr.contains("its launcher was lost"),
        "{stdout}{stderr}"
    );
}

/// `launch --detach --slurm --nnodes 2 --requeue --time 10m`: submitted with `sbatch`
/// as one launcher on each of the two nodes under `srun`; Slurm's warning signal to the
/// job's step (`scancel --signal=USR1`, what `--signal=USR1@90` sends before the time
/// limit) reaches every rank through its launcher, the ranks checkpoint and exit 75,
/// node 0's launcher requeues the job, and the second run resumes and ends with one
/// process's parameters, bit for bit.
#[test]
fn launch_submits_across_nodes_and_requeues_on_slurms_signal() {
    let Some(cluster) = Cluster::two_nodes("sr", 1) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    reference(dir, "ddp.py", DDP);
    let python = tt_testkit::python_path();
    let out = slurm(&cluster, dir, env!("CARGO_BIN_EXE_torchtools"))
        .args(["launch", "--detach", "--slurm", "--nnodes", "2"])
        .args(["--nproc-per-node", "1", "--requeue", "--time", "10m"])
        .args(["--log-dir", "logs", "--"])
        .args([python.as_str(), "ddp.py", "job.ckpt", "job.out"])
        .env("TT_WAIT", "1")
        .env_remove("OMP_NUM_THREADS")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", cluster.logs());
    let job = stdout.trim().to_owned();
    let log =
        || std::fs::read_to_string(dir.join(format!("logs/slurm-{job}.out"))).unwrap_or_default();
    crate::common::until("both ranks wait for Slurm's signal", || {
        let log = log();
        (0..2).all(|r| log.contains(&format!("rank {r} waiting for Slurm's signal at step 20")))
    });
    signal_until_requeued_and_completed(&cluster, dir, &job, &[], &log);
    let log = log();
    for line in [
        "[rank0]: rank 0 of 2 on ttsrav",
        "[rank1]: rank 1 of 2 on ttsrbv",
        "checkpointed on SIGUSR1 at step 20",
        &format!("requeuing Slurm job {job}, whose next run resumes (SLURM_RESTART_COUNT=1)"),
        &format!("Slurm job {job}, run 2 (SLURM_RESTART_COUNT=1)"),
        "rank 1 resumed at step 20 in run 2",
        "trained in run 2",
    ] {
        assert!(log.contains(line), "no {line:?} in\n{log}");
    }
    assert_eq!(
        log.matches("requeuing Slurm job").count(),
        1,
        "one launcher requeues the job: {log}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("job.out")).unwrap(),
        std::fs::read_to_string(dir.join("ref.out")).unwrap(),
        "the requeued two-node run's parameters differ from one process's"
    );
}
