//! `torchtools probe` and `torchtools run` as users run them.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::process::{Command, Output};

fn torchtools(args: &[&str], lock_dir: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(args)
        .env("TORCHTOOLS_LOCK_DIR", lock_dir)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The setup venv's Python: fails, never falls back to another interpreter.
fn python() -> String {
    tt_testkit::python_path()
}

#[test]
fn probe_reports_the_peak_and_the_estimate() {
    let tmp = tempfile::tempdir().unwrap();
    let py = python();
    let out = torchtools(
        &[
            "probe",
            "--json",
            "--",
            &py,
            "-c",
            "x = bytearray(b'1') * (100 << 20)",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        out.stdout.ends_with(b"}\n"),
        "a JSON document ends with a newline"
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Durations are seconds, as a number (not serde's {"secs", "nanos"}).
    let seconds = json["duration"].as_f64().unwrap_or(-1.0);
    assert!(seconds > 0.0 && seconds < 600.0, "{json}");
    let peak = json["rss_peak"].as_u64().unwrap();
    assert!(peak >= 100 << 20, "{json}");
    assert!(json["estimate"].as_u64().unwrap() > peak);
    assert!(
        stderr(&out).contains("probing"),
        "a progress line: {}",
        stderr(&out)
    );
}

#[test]
fn probe_failures_exit_non_zero_with_the_commands_stderr() {
    let tmp = tempfile::tempdir().unwrap();
    let out = torchtools(
        &["probe", "--", "sh", "-c", "echo broken >&2; exit 5"],
        tmp.path(),
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("exited with status 5") && stderr(&out).contains("broken"),
        "{}",
        stderr(&out)
    );
    let out = torchtools(&["probe", "--", "no-such-command-tt"], tmp.path());
    assert_eq!(out.status.code(), Some(127), "{}", stderr(&out));
    let out = torchtools(&["probe", "--steps", "0", "--", "true"], tmp.path());
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn run_probes_then_reserves_then_runs_for_real() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log");
    let script = format!(
        "echo \"probe=$TORCHTOOLS_PROBE gpu=$CUDA_VISIBLE_DEVICES\" >> {}",
        log.display()
    );
    let out = torchtools(
        &[
            "run",
            "--probe",
            "--probe-steps",
            "2",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            &script,
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("probe=1"), "the probe run: {text}");
    assert!(lines[1].starts_with("probe= gpu="), "the real run: {text}");
    assert!(stderr(&out).contains("reserving"), "{}", stderr(&out));
    // --bytes skips the probe; neither is a usage error.
    let out = torchtools(
        &[
            "run",
            "--bytes",
            "1GiB",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            "exit 4",
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(4));
    let out = torchtools(&["run", "--", "true"], tmp.path());
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_failed_probe_exits_1_and_the_command_never_runs_for_real() {
    let tmp = tempfile::tempdir().unwrap();
    let mark = tmp.path().join("ran-for-real");
    // Fails in probe mode only; would leave a mark when run for real.
    let script = format!(
        "if [ -n \"$TORCHTOOLS_PROBE\" ]; then echo 'probe broke' >&2; exit 3; fi; touch {}",
        mark.display()
    );
    let out = torchtools(
        &[
            "run",
            "--probe",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "sh",
            "-c",
            &script,
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("exited with status 3") && stderr(&out).contains("probe broke"),
        "{}",
        stderr(&out)
    );
    assert!(!mark.exists(), "nothing runs for real after a failed probe");
    // `probe` alone: the same status 1.
    let out = torchtools(&["probe", "--", "sh", "-c", "exit 5"], tmp.path());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

#[test]
fn probe_max_batch_predicts_from_three_probes_and_names_a_script_without_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let py = python();
    // base + 4 MiB per sample, written (so resident).
    let script = "import os, time\nb = int(os.environ['TORCHTOOLS_PROBE_BATCH'])\n\
                  x = b'\\x01' * (b << 22)\ntime.sleep(0.5)\n";
    let out = torchtools(
        &[
            "probe",
            "--max-batch",
            "--capacity",
            "512MiB",
            "--json",
            "--",
            &py,
            "-c",
            script,
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["probes"].as_array().unwrap().len(), 3, "{json}");
    let batch = json["batch"].as_u64().unwrap();
    let per_sample = json["line"]["per_sample"].as_f64().unwrap() / (1u64 << 20) as f64;
    assert!((3.8..4.2).contains(&per_sample), "{json}");
    // (512 MiB - 32 MiB) / 1.03 = 466 MiB for the interpreter and the batch.
    assert!((95..=116).contains(&batch), "{json}");
    assert!(json["reserve"].as_u64().unwrap() <= 512 << 20, "{json}");
    // A script that does not read the variable: named, exit 1.
    let out = torchtools(
        &[
            "probe",
            "--max-batch",
            "--capacity",
            "512MiB",
            "--",
            &py,
            "-c",
            "x = b'1' * (50 << 20)",
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("TORCHTOOLS_PROBE_BATCH"),
        "{}",
        stderr(&out)
    );
    // The batch options need --max-batch.
    let out = torchtools(&["probe", "--capacity", "1GiB", "--", "true"], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// A command that does not answer the probe (it runs until the probe's timeout) is said
/// to be one, never reported as having run its steps; `run --probe` reserves nothing
/// from it and does not run it again.
#[test]
fn a_command_that_does_not_answer_the_probe_is_named_and_not_run_for_real() {
    let tmp = tempfile::tempdir().unwrap();
    let marker = tmp.path().join("runs");
    let script = format!("echo run >> {}; sleep 60", marker.display());
    let out = torchtools(
        &[
            "run",
            "--probe",
            "--probe-timeout",
            "1s",
            "--",
            "sh",
            "-c",
            &script,
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("does not answer the probe: measured its first"),
        "{err}"
    );
    assert!(err.contains("TORCHTOOLS_PROBE_STEPS"), "{err}");
    assert!(!err.contains("5 step(s) in"), "{err}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap().lines().count(), 1);
    // `probe` reports the measurement, said as such.
    let out = torchtools(
        &["probe", "--timeout", "1s", "--", "sh", "-c", "sleep 60"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("does not answer the probe"));
}
