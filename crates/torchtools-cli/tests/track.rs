//! `torchtools track` as users run it: real commands, exit statuses, reports.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn track(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("track")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The setup venv's Python (`TORCHTOOLS_PYTHON`, set for cargo), else `python3`.
fn python() -> String {
    std::env::var("TORCHTOOLS_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_exit_status_is_the_commands_and_the_report_is_always_written() {
    let tmp = tempfile::tempdir().unwrap();
    for (script, code) in [("exit 0", 0), ("exit 3", 3), ("kill -9 $$", 137)] {
        let out_file = tmp.path().join(format!("r{code}.json"));
        let out = track(&[
            "--format",
            "json",
            "--output",
            out_file.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            script,
        ]);
        assert_eq!(out.status.code(), Some(code), "{script}: {}", stderr(&out));
        let r = report(&out_file);
        assert_eq!(r["torchtools"]["exit_status"], code, "{r}");
        assert!(r["max_ram"]["main"]["total_rss"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn a_missing_command_exits_127_with_a_message() {
    let out = track(&["--", "no-such-command-tt"]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).contains("cannot run \"no-such-command-tt\""),
        "{}",
        stderr(&out)
    );
}

#[test]
fn arguments_are_passed_as_they_are_not_split_on_spaces() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("a file with spaces");
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "--", "touch"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(target.exists());
}

#[test]
fn the_text_report_goes_to_stderr_in_gpu_trackers_layout() {
    let out = track(&[
        "--ram-unit",
        "megabytes",
        "--time-unit",
        "seconds",
        "--",
        "sleep",
        "0.2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stderr(&out);
    assert!(text.starts_with("Resource tracking complete. Process completed with status code: 0\nMax RAM:\n   Unit: megabytes\n"), "{text}");
    for needle in [
        "CPU utilization:",
        "Compute time:\n   Unit: seconds",
        "torchtools:",
        "Peak methods:",
    ] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    assert!(out.stdout.is_empty());
}

#[test]
fn a_forwarded_signal_ends_the_command_and_the_report_is_still_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("r.json");
    let child = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "--format", "json", "--output"])
        .arg(&out_file)
        .args(["--", "sleep", "30"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + libc::SIGINT));
    assert_eq!(report(&out_file)["torchtools"]["exit_status"], 130);
}

#[test]
fn bad_arguments_exit_2() {
    for (args, needle) in [
        (&["--interval", "5ms", "--", "true"][..], "10ms"),
        (
            &["--interval", "soon", "--", "true"][..],
            "is not a duration",
        ),
        (&["--ram-unit", "MB", "--", "true"][..], "megabytes"),
        (&["--format", "yaml", "--", "true"][..], "yaml"),
        (&[][..], "<CMD>"),
    ] {
        let out = track(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn timeline_plot_and_compare() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_owned();
    for (name, mib) in [("small", 16), ("large", 128)] {
        let script = format!("import time; x = bytearray({mib} << 20); time.sleep(0.3)");
        let out = track(&[
            "--interval",
            "20ms",
            "--ram-unit",
            "megabytes",
            "--format",
            "json",
            "--output",
            &p(&format!("{name}.json")),
            "--timeline",
            &p(&format!("{name}.csv")),
            "--plot",
            &p(&format!("{name}.svg")),
            "--",
            &python(),
            "-c",
            &script,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            std::fs::read_to_string(p(&format!("{name}.csv")))
                .unwrap()
                .lines()
                .count()
                > 5
        );
        assert!(std::fs::read_to_string(p(&format!("{name}.svg")))
            .unwrap()
            .starts_with("<svg"));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "compare", &p("small.json"), &p("large.json")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("small") && text.contains("large"), "{text}");
    assert!(text.contains("max RAM combined total RSS"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "compare", &p("small.json"), &p("missing.json")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
}
