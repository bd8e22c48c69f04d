//! A Rust program's own requeue of its Slurm job, under a real Slurm
//! (`tt_testkit::slurm::Cluster`: Debian's daemons, started as root).

use std::time::Duration;

use tt_testkit::slurm::Cluster;

/// What the job says, read from its output file.
fn log(dir: &std::path::Path) -> String {
    std::fs::read_to_string(dir.join("job.log")).unwrap_or_default()
}

/// An `sbatch --requeue` job of this test binary's [`requeuing_child`]: on its first
/// run it requeues its own job (`slurm_requeue_self_saying`: `scontrol requeue`) and
/// exits 75, as a trainer does after its checkpoint; Slurm runs it again with
/// `SLURM_RESTART_COUNT=1`, and it completes.
#[test]
fn a_program_requeues_its_own_slurm_job_which_runs_again() {
    let Some(cluster) = Cluster::one_node(1) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let script = dir.join("job.sh");
    let args = tt_testkit::rerun_args("requeuing_child").join(" ");
    std::fs::write(&script, format!("#!/bin/sh\nexec \"$TEST_BIN\" {args}\n")).unwrap();
    let out = cluster
        .command("sbatch")
        .args(["--parsable", "--requeue", "--open-mode=append"])
        .arg(format!("--output={}", dir.join("job.log").display()))
        .arg(format!("--chdir={}", dir.display()))
        .arg(&script)
        .env("TEST_BIN", std::env::current_exe().unwrap())
        .env("TT_REQUEUING_CHILD", "1")
        .env_remove(tt_device::TORCHTOOLS_REQUEUES_SLURM_JOB)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
    let job = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let state = || {
        let out = cluster
            .command("scontrol")
            .args(["show", "job", &job])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let start = std::time::Instant::now();
    loop {
        let said = state();
        assert!(
            !said.contains("JobState=FAILED") && !said.contains("JobState=CANCELLED"),
            "{said}\n{}",
            log(dir)
        );
        if said.contains("JobState=COMPLETED") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the job did not complete: {said}\n{}\n{}",
            log(dir),
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(state().contains("Restarts=1"), "{}", state());
    let said = log(dir);
    for line in [
        format!("run 1 of Slurm job {job}"),
        format!("requeuing Slurm job {job}"),
        format!("run 2 of Slurm job {job}: done"),
    ] {
        assert!(said.contains(&line), "no {line:?} in\n{said}");
    }
}

/// The job of [`a_program_requeues_its_own_slurm_job_which_runs_again`].
#[test]
#[ignore = "run inside a Slurm job by a_program_requeues_its_own_slurm_job_which_runs_again"]
fn requeuing_child() {
    if std::env::var_os("TT_REQUEUING_CHILD").is_none() {
        return;
    }
    let job = tt_device::slurm_job_id().expect("inside a Slurm job");
    let run = tt_device::slurm_restart_count() + 1;
    println!("run {run} of Slurm job {job}");
    if run > 1 {
        println!("run {run} of Slurm job {job}: done");
        return;
    }
    let done = tt_device::slurm_requeue_self_saying(|job| println!("requeuing Slurm job {job}"))
        .expect("scontrol requeue");
    assert_eq!(done, tt_device::SelfRequeue::Requeued(job));
    // As a trainer after its checkpoint; Slurm ends the job's processes meanwhile.
    std::process::exit(75);
}
