//! The facade end to end: its re-exports, and the demo binary started the way a user
//! starts a binary (another directory, no LD_LIBRARY_PATH).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_facade_reexports_device_selection_and_the_shim() {
    let device = torchtools::device::select().unwrap();
    let t = torchtools::tch::Tensor::ones([4], (torchtools::tch::Kind::Float, device));
    assert_eq!(t.sum(torchtools::tch::Kind::Float).double_value(&[]), 4.0);
    assert_eq!(torchtools::sys::libtorch_version(), "2.11.0");
}

fn demo_binary() -> PathBuf {
    // target/debug/deps/demo-<hash> -> target/debug/examples/demo (cargo test builds examples).
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/demo")
}

#[test]
fn the_demo_runs_its_six_parts_and_their_checks_from_any_directory() {
    // The reduced mode `cargo xtask test` runs: every part, less data. Its checks (the
    // resumed run bit for bit the uninterrupted one, 2 ranks equal to 1 process) make
    // it exit non-zero when they fail.
    let demo = demo_binary();
    assert!(demo.exists(), "{} was not built", demo.display());
    let out_dir = tempfile::tempdir().unwrap();
    let out = tt_testkit::hang::within(std::time::Duration::from_secs(900), "the demo", {
        let (demo, dir) = (demo.clone(), out_dir.path().to_path_buf());
        move || {
            Command::new(&demo)
                .args(["--quick", "--out"])
                .arg(&dir)
                .current_dir(std::env::temp_dir())
                .env_remove("LD_LIBRARY_PATH")
                .env_remove("TORCHTOOLS_DEVICE")
                .output()
                .unwrap()
        }
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    for part in [
        "== 1. the device",
        "== 2. probe and reservation",
        "== 3. training",
        "== 4. interruption and resume",
        "== 5. the same training on 2 DDP ranks",
        "== 6. summary",
    ] {
        assert!(stdout.contains(part), "{part:?} missing: {stdout}");
    }
    assert!(
        stdout.contains("torchtools device report (libtorch's view)"),
        "{stdout}"
    );
    assert!(stdout.contains("intra-op threads set to "), "{stdout}");
    assert!(stdout.contains("probe of one training step"), "{stdout}");
    assert!(stdout.contains("GPU locks in "), "{stdout}");
    assert!(
        stdout.contains("SIGKILL sent right after the checkpoint of step 6"),
        "{stdout}"
    );
    // Checkpoints are written in the background: the run killed once step 6's is
    // durable resumes from it, or from step 9's if that one landed before the signal.
    assert!(
        stdout.contains("resumed from the checkpoint of step 6")
            || stdout.contains("resumed from the checkpoint of step 9"),
        "{stdout}"
    );
    assert!(
        stdout.contains("bit for bit the uninterrupted run's"),
        "{stdout}"
    );
    assert!(
        stdout.contains("2 ranks on cpu x 1024 samples end where 1 process x 2048 does"),
        "{stdout}"
    );
    if !stdout.contains("on cuda") {
        // On the CPU the memory limit makes the adaptation visible: the trainer's
        // micro-batch is smaller than the batch of 2048.
        let micro = stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix("micro-batch "))
            .filter(|rest| rest.contains("found by the trainer"))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<usize>().ok());
        assert!(micro.is_some_and(|m| m < 2048), "{stdout}");
    }
    let svg = std::fs::read_to_string(out_dir.path().join("demo.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    let kept = std::fs::read_dir(out_dir.path().join("checkpoints-run"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert_eq!(kept, 3, "the last three checkpoints are kept");
}

#[test]
fn the_demo_refuses_bad_input_with_a_clear_error() {
    let out = Command::new(demo_binary()).arg("--steps").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown argument \"--steps\"") && stderr.contains("usage: demo"),
        "{stderr}"
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(demo_binary())
        .arg("--out")
        .arg(file.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--out") && stderr.contains("cannot create it"),
        "{stderr}"
    );
    let out = Command::new(demo_binary())
        .env("TORCHTOOLS_DEVICE", "cuda:9")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("TORCHTOOLS_DEVICE=\"cuda:9\""));
}

/// The child of the thread test: libtorch set to 5 threads, then the facade's call.
#[test]
#[ignore = "a child process's entry point, run by the thread test"]
fn threads_child() {
    if std::env::var_os("TT_THREADS_CHILD").is_none() {
        return;
    }
    torchtools::tch::set_num_threads(5);
    let budget = torchtools::use_allowed_threads();
    println!(
        "@@ libtorch {} budget {} reason {}",
        torchtools::tch::get_num_threads(),
        budget.threads,
        budget.reason
    );
}

#[test]
fn use_allowed_threads_follows_the_affinity_mask_and_omp_num_threads() {
    let run = |omp: Option<&str>| {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", "0"])
            .arg(exe)
            .args(tt_testkit::rerun_args("threads_child"))
            .env("TT_THREADS_CHILD", "1")
            .env_remove("OMP_NUM_THREADS");
        if let Some(v) = omp {
            cmd.env("OMP_NUM_THREADS", v);
        }
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("taskset (util-linux): {e}"));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{out:?}");
        text.lines()
            .find_map(|l| l.split_once("@@ ").map(|(_, report)| report.to_owned()))
            .unwrap_or_else(|| panic!("no report: {text}"))
    };
    // One CPU in the mask: one thread, whatever libtorch had.
    let line = run(None);
    assert!(line.starts_with("libtorch 1 budget 1 reason "), "{line}");
    if std::thread::available_parallelism().map_or(1, usize::from) > 1 {
        assert!(
            line.contains("1 CPU(s) in this process's affinity mask"),
            "{line}"
        );
    }
    // OMP_NUM_THREADS is the user's decision: kept.
    let line = run(Some("3"));
    assert!(
        line.starts_with("libtorch 3 budget 3 reason OMP_NUM_THREADS=3"),
        "{line}"
    );
}
