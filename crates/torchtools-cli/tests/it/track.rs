//! `torchtools track` as users run it: real commands, exit statuses, reports.

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

/// The setup venv's Python (`TORCHTOOLS_PYTHON`, set for cargo), with gpu-tracker
/// 5.0.1: fails, never skips or falls back to another Python, without it.
fn python() -> String {
    tt_testkit::python_path()
}

/// `out` is a refusal before anything ran: exit 2, saying `needle`.
fn refused(out: &Output, needle: &str) {
    assert_eq!(out.status.code(), Some(2), "{}", stderr(out));
    assert!(stderr(out).contains(needle), "{needle}: {}", stderr(out));
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
fn the_text_report_goes_to_stdout_in_gpu_trackers_layout() {
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
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(text.starts_with("Resource tracking complete. Process completed with status code: 0\nMax RAM:\n   Unit: megabytes\n"), "{text}");
    for needle in [
        "CPU utilization:",
        "Compute time:\n   Unit: seconds",
        "torchtools:",
        "Peak methods:",
    ] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    assert!(
        !stderr(&out).contains("Max RAM"),
        "the report is on stdout only"
    );
}

/// Every key path of a JSON value (`max_ram.main.total_rss`, ...).
fn key_paths(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let Some(map) = v.as_object() {
        for (k, child) in map {
            let path = format!("{prefix}{k}");
            out.push(path.clone());
            key_paths(child, &format!("{path}."), out);
        }
    }
}

/// The labels of a text report, values dropped: its layout.
fn layout(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| match l.find(": ") {
            Some(i) => l[..i].to_owned(),
            None => l.trim_end().to_owned(),
        })
        .collect()
}

#[test]
fn the_same_command_line_as_gpu_tracker_gives_the_same_report() {
    let tmp = tempfile::tempdir().unwrap();
    let line = |format: &str, output: &Path| {
        vec![
            "-e".to_owned(),
            "sleep 0.2".to_owned(),
            "--ru=megabytes".to_owned(),
            "--gru=megabytes".to_owned(),
            "--tu=seconds".to_owned(),
            "--st=0.1".to_owned(),
            format!("--format={format}"),
            format!("--output={}", output.display()),
        ]
    };
    let mut outputs = Vec::new();
    for format in ["json", "text"] {
        let theirs = tmp.path().join(format!("theirs.{format}"));
        let ours = tmp.path().join(format!("ours.{format}"));
        let theirs_line = line(format, &theirs);
        let gt_stdout = tt_testkit::run_python_module(
            "gpu_tracker",
            &theirs_line.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let args = line(format, &ours);
        let tt = track(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(tt.status.success(), "{}", stderr(&tt));
        if format == "text" {
            assert_eq!(
                String::from_utf8_lossy(&tt.stdout),
                gt_stdout,
                "the same status line on stdout"
            );
        }
        outputs.push((
            std::fs::read_to_string(&theirs).unwrap(),
            std::fs::read_to_string(&ours).unwrap(),
        ));
    }
    // JSON: every key of gpu_tracker's, with the same units; ours adds `torchtools`.
    let (theirs, ours) = (&outputs[0].0, &outputs[0].1);
    let (theirs, ours): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(theirs).unwrap(),
        serde_json::from_str(ours).unwrap(),
    );
    let (mut tk, mut ok) = (Vec::new(), Vec::new());
    key_paths(&theirs, "", &mut tk);
    key_paths(&ours, "", &mut ok);
    ok.retain(|k| !k.starts_with("torchtools"));
    tk.sort();
    ok.sort();
    assert_eq!(ok, tk, "the same key tree");
    for unit in ["max_ram", "max_gpu_ram", "compute_time"] {
        assert_eq!(ours[unit]["unit"], theirs[unit]["unit"], "{unit}");
    }
    // Text: gpu_tracker's layout line for line, then ours.
    let (theirs, ours) = (layout(&outputs[1].0), layout(&outputs[1].1));
    assert_eq!(
        ours[..theirs.len()],
        theirs[..],
        "gpu_tracker's layout first"
    );
}

/// A command that leaves a mark when it runs.
fn marking(dir: &Path) -> (String, std::path::PathBuf) {
    let mark = dir.join("ran");
    (format!("touch {}", mark.display()), mark)
}

#[test]
fn a_bad_output_path_is_refused_before_the_command_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let (script, mark) = marking(tmp.path());
    let existing = tmp.path().join("old.csv");
    std::fs::write(&existing, "keep me").unwrap();
    let missing_dir = tmp.path().join("no/such/dir/r.json");
    let missing = missing_dir.to_str().unwrap();
    let missing_csv = missing_dir.with_extension("csv");
    let dir = tmp.path().to_str().unwrap();
    let unknown = tmp.path().join("t.parquet");
    let slash = format!("{}/", tmp.path().join("reports").display());
    let cases: [(Vec<&str>, &str); 8] = [
        (vec!["--output", missing], "does not exist"),
        // A missing directory named with a trailing slash: it used to run the command.
        (vec!["--output", &slash], "ends with / (a directory)"),
        (vec!["-o", dir], "is a directory"),
        (vec!["--plot", missing], "does not exist"),
        (
            vec!["--timeline", missing_csv.to_str().unwrap()],
            "does not exist",
        ),
        (
            vec!["--timeline", existing.to_str().unwrap()],
            "--overwrite",
        ),
        (vec!["--tf", unknown.to_str().unwrap()], "*.csv"),
        (vec!["--timeline", dir], "is a directory"),
    ];
    for (args, needle) in cases {
        let mut all = args.clone();
        all.extend(["--", "sh", "-c", &script]);
        let out = track(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
        assert!(!mark.exists(), "{args:?}: the command ran");
    }
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "keep me");
    // --overwrite allows the existing timeline; the command runs.
    let out = track(&[
        "--timeline",
        existing.to_str().unwrap(),
        "--overwrite",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(mark.exists());
}

#[test]
fn the_exit_status_survives_a_report_that_cannot_be_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("reports");
    std::fs::create_dir(&dir).unwrap();
    let report = dir.join("r.txt");
    // The directory is valid at start and gone at the end (a disk that filled, say).
    let script = format!("rm -r {}; exit 3", dir.display());
    let out = track(&["-o", report.to_str().unwrap(), "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("could not write the report to") && err.contains("r.txt"),
        "{err}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("Resource tracking complete. Process completed with status code: 3"),
        "the report is printed instead: {text}"
    );
}

#[test]
fn a_gpu_tracker_command_line_works_with_torchtools_track_in_front() {
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("r.json");
    let mark = tmp.path().join("ran");
    let line = format!("touch {}", mark.display());
    let out = track(&[
        "-e",
        &line,
        "--st=0.05",
        "--ru=megabytes",
        "--gru=kilobytes",
        "--tu=seconds",
        "--nec=1",
        "--gb=nvidia",
        "--disable-logs",
        "-f",
        "json",
        "-o",
        out_file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("splits the command on whitespace"));
    let r = report(&out_file);
    assert_eq!(r["max_ram"]["unit"], "megabytes");
    assert_eq!(r["max_gpu_ram"]["unit"], "kilobytes");
    assert_eq!(r["compute_time"]["unit"], "seconds");
    assert!(
        mark.exists(),
        "the -e line ran, split into a command and its argument"
    );
    // --tconfig: gpu_tracker's Tracker arguments; the command line wins.
    let config = tmp.path().join("tconfig.json");
    std::fs::write(
        &config,
        r#"{"ram_unit": "kilobytes", "time_unit": "minutes", "sleep_time": 0.05}"#,
    )
    .unwrap();
    let out = track(&[
        "--tconfig",
        config.to_str().unwrap(),
        "--ru",
        "megabytes",
        "-f",
        "json",
        "--",
        "true",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["max_ram"]["unit"], "megabytes", "the command line wins");
    assert_eq!(
        r["compute_time"]["unit"], "minutes",
        "the config fills the rest"
    );
    std::fs::write(&config, r#"{"sleep_tme": 1}"#).unwrap();
    let out = track(&["--tconfig", config.to_str().unwrap(), "--", "true"]);
    refused(&out, "unknown key \"sleep_tme\"");
    refused(&track(&["--gb", "amd", "--", "true"]), "NVIDIA GPUs only");
}

#[test]
fn the_timeline_has_no_row_of_a_dead_process_nor_a_cpu_of_zero_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let timeline = tmp.path().join("t.jsonl");
    // Busy for about a second: every interval sees CPU time.
    let out = track(&[
        "--interval",
        "200ms",
        "--timeline",
        timeline.to_str().unwrap(),
        "--",
        &python(),
        "-c",
        "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&timeline)
        .unwrap()
        .lines()
        .skip(1) // static data
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!rows.is_empty(), "at least one sample");
    for (i, row) in rows.iter().enumerate() {
        assert!(row["main_ram"].as_f64().unwrap() > 0.0, "row {i}: {row}");
        assert!(
            row["main_n_threads"].as_u64().unwrap() > 0,
            "row {i}: {row}"
        );
    }
    let first_cpu = rows[0]["cpu_main_sum_utilization_percent"]
        .as_f64()
        .unwrap();
    assert!(
        first_cpu > 0.0,
        "the first CPU figure covers a real interval: {}",
        rows[0]
    );
}

#[test]
fn a_forwarded_signal_ends_the_command_and_the_report_is_still_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("r.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "--format", "json", "--output"])
        .arg(&out_file)
        .args(["--", "sh", "-c", "echo ready; exec sleep 30"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The command is running, so torchtools's handlers are installed (before the
    // spawn): driven by the command's own line, never by a sleep.
    let stdout = child.stdout.take().unwrap();
    tt_testkit::wait_for_line(stdout, "ready", Duration::from_secs(120));
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
            &["--interval", "0", "--", "true"][..],
            "below the 10ms minimum",
        ),
        (&["--interval", "-1", "--", "true"][..], "is negative"),
        (&["--st", "-0.5", "--", "true"][..], "is negative"),
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
    // The peaks hold what each program allocated (the kernel's figure for the reaped
    // command), and the comparison shows each report's own figures.
    let (small, large) = (
        report(&tmp.path().join("small.json")),
        report(&tmp.path().join("large.json")),
    );
    let peak = |r: &serde_json::Value| r["max_ram"]["main"]["total_rss"].as_f64().unwrap();
    let mb = |mib: f64| mib * 1.048576;
    assert!(peak(&small) >= mb(16.0), "{small}");
    assert!(peak(&large) >= mb(128.0), "{large}");
    assert!(
        peak(&large) - peak(&small) >= mb(112.0) * 0.95,
        "{small} {large}"
    );
    // The command's own memory cgroup, where this machine lets us make one (root with
    // a memory controller, as CI is): its peak holds the 128 MiB too.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let memory_controller = Path::new("/sys/fs/cgroup/memory").is_dir()
        || std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.contains("memory"));
    match large["torchtools"]["cgroup_peak"].as_f64() {
        Some(cg) => assert!(cg >= mb(128.0), "{large}"),
        None => assert!(
            !(root && memory_controller),
            "a memory cgroup could be made here: {large}"
        ),
    }
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("max RAM main total RSS"))
        .unwrap_or_else(|| panic!("no main RSS row: {text}"));
    for r in [&small, &large] {
        let shown = format!("{:.3} megabytes", peak(r));
        assert!(row.contains(&shown), "{shown} in {row:?}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(["track", "compare", &p("small.json"), &p("missing.json")])
        .output()
        .unwrap();
    // Bad input, as `sub-track compare` says it: exit 2.
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
}

/// A wrapper's child's peak is the child's, never the wrapper's (gpu_tracker: main
/// 0.002 GB): wait4's ru_maxrss includes the children it reaped; the wrapper's own peak
/// is read as it exits.
#[test]
fn a_wrappers_peak_is_its_own_and_its_childs_is_under_descendants() {
    let tmp = tempfile::tempdir().unwrap();
    let wrap = tmp.path().join("wrap.sh");
    std::fs::write(
        &wrap,
        format!(
            "#!/bin/sh\n{} -c \"x = b'1' * (300 << 20)\"\necho done\n",
            python()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrap, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out_file = tmp.path().join("r.json");
    let out = track(&[
        "--format",
        "json",
        "--ram-unit",
        "megabytes",
        "--output",
        out_file.to_str().unwrap(),
        "--",
        wrap.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out_file);
    let main = r["max_ram"]["main"]["total_rss"].as_f64().unwrap();
    let desc = r["max_ram"]["descendants"]["total_rss"].as_f64().unwrap();
    assert!(main < 30.0, "the shell's own peak: {main} MB ({r})");
    assert!(desc > 300.0, "the Python child's 300 MiB: {desc} MB");
    assert!(
        r["torchtools"]["peak_methods"]["main"]
            .as_str()
            .unwrap_or("")
            .contains("exited"),
        "{r}"
    );
}

/// Watching the command's exit changes nothing it sees: a signal it sends itself
/// reaches its handler, and a stop (as Ctrl-Z) holds until SIGCONT.
#[test]
fn the_watched_command_gets_its_signals_and_its_stops() {
    let out = track(&[
        "--",
        "sh",
        "-c",
        "trap 'echo caught; exit 3' USR1; kill -USR1 $$; sleep 5",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("caught"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args([
            "track",
            "--",
            "sh",
            "-c",
            "echo $$; kill -STOP $$; echo resumed",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    let pid: i32 = line.trim().parse().unwrap();
    // Stopped: state T in /proc (a generous bound; driven by the state, not a sleep).
    let stopped = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit_once(") ")
                    .is_some_and(|(_, r)| r.starts_with('T') || r.starts_with('t'))
            })
            .unwrap_or(false)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !stopped(pid) {
        assert!(std::time::Instant::now() < deadline, "never stopped");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Still stopped a moment later: the watcher did not resume it.
    std::thread::sleep(Duration::from_millis(300));
    assert!(stopped(pid), "resumed without SIGCONT");
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(rest.contains("resumed"), "{rest}");
    assert!(child.wait().unwrap().success());
}

/// `gpu-tracker`, installed beside `torchtools`: a script written for the Python
/// gpu_tracker's command runs unchanged, with `torchtools track`'s report and exit
/// status; its sub-tracking commands are there too.
#[test]
fn gpu_tracker_command_lines_run_unchanged_on_the_gpu_tracker_command() {
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("usage.json");
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-tracker"))
        .args(["-e", "sh -c exit", "-f", "json", "-o"])
        .arg(&out_file)
        .args(["--ru=megabytes", "--st=0.1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out_file);
    assert_eq!(r["max_ram"]["unit"], "megabytes", "{r}");
    assert!(r["max_ram"]["descendants"]["total_rss"].is_number(), "{r}");
    // The command's status, as `torchtools track` gives it. (`-e` splits on
    // whitespace, as gpu_tracker's does: a script file, not `sh -c 'exit 3'`.)
    let script = tmp.path().join("exit3.sh");
    std::fs::write(&script, "exit 3\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-tracker"))
        .arg("-e")
        .arg(format!("sh {}", script.display()))
        .arg("--disable-logs")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-tracker"))
        .args(["sub-track", "analyze", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("--tf"),
        "{out:?}"
    );
}
