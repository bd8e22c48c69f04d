//! The real binary, in real processes, with controlled environments.

use std::process::{Command, Output};

fn torchtools(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torchtools"));
    cmd.args(args);
    for var in ["TORCHTOOLS_DEVICE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"] {
        cmd.env_remove(var);
    }
    cmd.envs(vars.iter().copied());
    cmd.output().unwrap()
}

/// The commands `torchtools --help` lists, in its order (not `help`).
fn commands_in_help() -> Vec<String> {
    let help = torchtools(&["--help"], &[]);
    String::from_utf8_lossy(&help.stdout)
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

fn has_nvml() -> bool {
    let out = torchtools(&["devices", "--json"], &[]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["nvml"]["status"] == "available"
}

#[test]
fn devices_prints_the_report_and_selection() {
    let out = torchtools(&["devices"], &[("TORCHTOOLS_DEVICE", "cpu")]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with("torchtools device report (NVML's view, without libtorch)"),
        "{text}"
    );
    assert!(
        text.contains("selected     cpu (TORCHTOOLS_DEVICE=cpu)"),
        "{text}"
    );
    assert!(text.contains("TORCHTOOLS_DEVICE=\"cpu\""), "{text}");
}

#[test]
fn devices_json_is_machine_readable() {
    let out = torchtools(&["devices", "--json"], &[("LOCAL_RANK", "0")]);
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["view"], "nvml");
    assert_eq!(json["env"]["local_rank"], "0");
    let device = json["selected"]["device"].as_str().unwrap();
    if has_nvml() {
        assert!(device.starts_with("cuda:"), "{json}");
    } else {
        assert_eq!(device, "cpu", "{json}");
        assert!(
            json["backends"][0]["detail"]
                .as_str()
                .unwrap()
                .contains("NVML"),
            "{json}"
        );
    }
}

#[test]
fn bad_values_exit_2_and_name_the_variable() {
    let mut lines = String::new();
    for (var, value) in [
        ("TORCHTOOLS_DEVICE", "gpu"),
        ("LOCAL_RANK", "first"),
        ("CUDA_VISIBLE_DEVICES", "0,,1"),
        ("TORCHTOOLS_DEVICE", "cuda:99"),
    ] {
        let out = torchtools(&["devices"], &[(var, value)]);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(stderr.contains(var), "{stderr}");
        // The text report still comes first, with the reason in it.
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(stdout.contains("selected     none: "), "{stdout}");
        if value != "cuda:99" {
            lines.push_str(&stderr);
        }
    }
    insta::assert_snapshot!(lines);
}

#[test]
fn cuda_without_a_usable_gpu_is_refused_with_the_reason() {
    // CUDA_VISIBLE_DEVICES="" leaves no GPU on any machine: without a driver the
    // reason is the driver, with one it is the variable hiding every GPU.
    let out = torchtools(
        &["devices"],
        &[("TORCHTOOLS_DEVICE", "cuda"), ("CUDA_VISIBLE_DEVICES", "")],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    let reason = if has_nvml() {
        "CUDA is not usable: CUDA_VISIBLE_DEVICES=\"\" hides all "
    } else {
        "CUDA is not usable: no NVIDIA driver (NVML: "
    };
    assert!(stderr.contains(reason), "{reason}: {stderr}");
    assert!(
        stderr.contains("set TORCHTOOLS_DEVICE=cpu (or auto)"),
        "the fix: {stderr}"
    );
}

#[test]
fn unknown_subcommands_and_flags_are_usage_errors() {
    let out = torchtools(&["devcies"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecognized subcommand"));
    let out = torchtools(&["devices", "--jsn"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

/// Every command in `torchtools --help` refuses a bad argument with exit status 2 and
/// the reason, before anything runs: a bad value where it takes one, an unexpected
/// word where it takes none. A new command must be added here.
#[test]
fn bad_arguments_exit_2_for_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("locks");
    let dir = dir.to_str().unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "devices",
            &["devices", "--json", "x"],
            "unexpected argument 'x'",
        ),
        (
            "reserve",
            &["reserve", "--gpu", "0", "--bytes", "6XB", "--", "true"],
            "is not a size",
        ),
        (
            "track",
            &["track", "--interval", "5ms", "--", "true"],
            "10ms minimum",
        ),
        (
            "probe",
            &["probe", "--gpu", "0", "--steps", "zero", "--", "true"],
            "'zero'",
        ),
        (
            "run",
            &[
                "run", "--detach", "--gpu", "0", "--bytes", "6XB", "--", "true",
            ],
            "is not a size",
        ),
        (
            "launch",
            &["launch", "--nproc-per-node", "0", "--", "true"],
            "not a count",
        ),
        ("locks", &["locks", "x"], "unexpected argument 'x'"),
        ("jobs", &["jobs", "wait"], "<JOBS>"),
        ("logs", &["logs", "no-such-job"], "no job \"no-such-job\""),
        (
            "stop",
            &["stop", "last", "--grace", "soon"],
            "is not a duration",
        ),
        (
            "usage",
            &["usage", "--since", "yesterday"],
            "is not a duration",
        ),
        (
            "metrics",
            &["metrics", "--listen", "nowhere"],
            "invalid socket address",
        ),
        (
            "serve",
            &["serve", "--replay", "/nonexistent/state.json"],
            "--replay",
        ),
        ("queue", &["queue", "x"], "unexpected argument 'x'"),
        ("policy", &["policy", "x"], "unexpected argument 'x'"),
        (
            "top",
            &["top", "--interval", "1"],
            "unexpected argument '--interval'",
        ),
    ];
    let commands = commands_in_help();
    let covered: Vec<&str> = cases.iter().map(|(c, _, _)| *c).collect();
    assert_eq!(commands, covered, "every command, in --help's order");
    for (command, args, says) in cases {
        let out = torchtools(
            args,
            &[
                ("TORCHTOOLS_LOCK_DIR", dir),
                ("XDG_STATE_HOME", tmp.path().join("state").to_str().unwrap()),
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {err}");
        assert!(err.contains(says), "{command}: {err}");
    }
}

/// Variables every command depends on are checked before any command runs: a bad one
/// exits 2 naming it, its value and the fix; libtorch would ignore a bad
/// OMP_NUM_THREADS silently, tracing a bad filter.
#[test]
fn a_bad_log_filter_or_thread_count_exits_2_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let script = format!("touch {}", marker.display());
    for (var, value) in [
        ("TORCHTOOLS_LOG", "[[["),
        ("OMP_NUM_THREADS", "abc"),
        ("OMP_NUM_THREADS", "0"),
    ] {
        let out = torchtools(&["launch", "--", "sh", "-c", &script], &[(var, value)]);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("{var}={value:?}")), "{err}");
        assert!(!marker.exists(), "{var}={value}: the command ran");
    }
    // Good values pass.
    let out = torchtools(
        &["launch", "--", "sh", "-c", &script],
        &[
            ("TORCHTOOLS_LOG", "tt_dist=debug,warn"),
            ("OMP_NUM_THREADS", "2"),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(marker.exists());
}

/// The man pages: one for `torchtools` and one for each command and subcommand `--help`
/// lists, each rendered by `man` without a warning, and found by `man NAME` once in a
/// `man1` directory on `MANPATH` (the documented install).
#[test]
fn man_pages_render_without_a_warning_and_are_found_once_installed() {
    let tmp = tempfile::tempdir().unwrap();
    let man1 = tmp.path().join("man/man1");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("generate-man")
        .arg(&man1)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let commands = commands_in_help();
    assert!(commands.len() >= 16, "{commands:?}");
    for name in std::iter::once("torchtools".to_owned())
        .chain(commands.iter().map(|c| format!("torchtools-{c}")))
        .chain([
            "torchtools-jobs-wait".to_owned(),
            "torchtools-track-sub-track-analyze".to_owned(),
        ])
    {
        let page = man1.join(format!("{name}.1"));
        assert!(page.exists(), "no {}", page.display());
        let shown = std::process::Command::new("man")
            .args(["--warnings", "-E", "UTF-8", "-l"])
            .arg(&page)
            .env("MANWIDTH", "80")
            .env("LC_ALL", "C.UTF-8")
            .output()
            .unwrap();
        assert!(
            shown.status.success() && shown.stderr.is_empty(),
            "{name}: {}",
            String::from_utf8_lossy(&shown.stderr)
        );
        assert!(
            String::from_utf8_lossy(&shown.stdout).contains("NAME"),
            "{name}"
        );
    }
    let found = std::process::Command::new("man")
        .arg("torchtools-reserve")
        .env("MANPATH", tmp.path().join("man"))
        .env("MANWIDTH", "80")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&found.stdout);
    assert!(
        found.status.success() && text.contains("Reserve GPUs, then run a command on them"),
        "{found:?}"
    );
}
