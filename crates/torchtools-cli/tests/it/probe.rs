//! `torchtools probe` and `torchtools run` as users run them.

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

/// `--bytes auto` on `reserve` (alone and `--share`) and `launch`: the command is
/// probed first (one rank of a launch, with torchrun's variables), what was measured
/// is said and reserved; a command that does not answer the probe is refused and never
/// runs for real.
#[test]
fn bytes_auto_probes_then_reserves_what_was_measured() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log");
    let py = python();
    // 300 MB held in probe mode and for real: the reservation must cover it.
    let script = format!(
        "import os; b = bytearray(300_000_000); \
         open({:?}, 'a').write(f\"probe={{os.environ.get('TORCHTOOLS_PROBE', '')}} \
         rank={{os.environ.get('RANK', '')}}/{{os.environ.get('WORLD_SIZE', '')}}\\n\")",
        log.display().to_string()
    );
    let out = torchtools(
        &[
            "reserve",
            "--bytes",
            "auto",
            "--probe-steps",
            "2",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            &py,
            "-c",
            &script,
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "probe=1 rank=/\nprobe= rank=/\n"
    );
    let err = stderr(&out);
    assert!(
        err.contains("(--bytes auto)") && err.contains("peak"),
        "{err}"
    );
    // The reservation carries the measured bytes: its usage record says them.
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let record = std::fs::read_to_string(tmp.path().join(format!("usage-{uid}.jsonl"))).unwrap();
    let start: serde_json::Value = serde_json::from_str(record.lines().next().unwrap()).unwrap();
    let reserved = start["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no reserved bytes in {record}"));
    assert!(reserved >= 300_000_000, "{reserved} < the 300 MB it used");

    // A launch probes one rank, as rank 0 of 1. On this machine the fence it then asks
    // for cannot be raised without NVML; the probe ran and was said before.
    std::fs::remove_file(&log).unwrap();
    let out = torchtools(
        &[
            "launch",
            "--gpu",
            "0",
            "--bytes",
            "auto",
            "--nproc-per-node",
            "2",
            "--",
            &py,
            "-c",
            &script,
        ],
        tmp.path(),
    );
    let err = stderr(&out);
    assert!(err.contains("(--bytes auto)"), "{err}");
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .starts_with("probe=1 rank=0/1\n"),
        "{err}"
    );

    // A command that does not answer the probe: refused, never run for real.
    let mark = tmp.path().join("runs");
    let sleeper = format!("echo run >> {}; sleep 60", mark.display());
    let out = torchtools(
        &[
            "reserve",
            "--share",
            "--bytes",
            "auto",
            "--probe-timeout",
            "1s",
            "--gpu",
            "0",
            "--",
            "sh",
            "-c",
            &sleeper,
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("instead of --bytes auto"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&mark).unwrap().lines().count(), 1);
}
