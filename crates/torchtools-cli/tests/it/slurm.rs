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

    let out = slurm(&cluster, dir, "srun")
        .args(["--gres=gpu:2", "sh", "-c"])
        .arg(
            "echo job=$SLURM_JOB_ID; \
             exec \"$TT\" reserve --gpu 1 --no-fence -- \"$TT\" locks",
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
