//! `--on-end`: the hook runs exactly once however a job ends (exit 0, exit 3, `stop`,
//! cancelled, its keeper or torchtools killed with SIGKILL), attached and detached,
//! with the job's variables and the end of its log; a hook that fails or hangs never
//! changes the job's status; the config's default hook, and a bad config refused.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{detach, ok, tt, until};

/// A hook that appends, to `dir/hooks/<name>`, its `TORCHTOOLS_JOB_*` variables, a
/// `--- stdin` line and what it read (one block per run); `name` is the job's id, or
/// `attached`.
fn recorder(dir: &Path) -> String {
    std::fs::create_dir_all(dir.join("hooks")).unwrap();
    format!(
        "f={}/${{TORCHTOOLS_JOB_ID:-attached}}; {{ env | grep ^TORCHTOOLS_JOB_ | sort; \
         echo '--- stdin'; cat; }} >> \"$f\"",
        dir.join("hooks").display()
    )
}

/// The runs of the hook recorded under `name`: each one's variables and its input.
fn runs(dir: &Path, name: &str) -> Vec<(BTreeMap<String, String>, String)> {
    let Ok(text) = std::fs::read_to_string(dir.join("hooks").join(name)) else {
        return Vec::new();
    };
    let mut runs = Vec::new();
    let mut vars = BTreeMap::new();
    let mut input: Option<String> = None;
    for line in text.lines() {
        match (&mut input, line) {
            (None, "--- stdin") => input = Some(String::new()),
            (None, l) => {
                let (k, v) = l.split_once('=').unwrap();
                let k = k.strip_prefix("TORCHTOOLS_JOB_").unwrap().to_owned();
                vars.insert(k, v.to_owned());
            }
            (Some(_), l) if l.starts_with("TORCHTOOLS_JOB_COMMAND=") => {
                runs.push((std::mem::take(&mut vars), input.take().unwrap()));
                let (k, v) = l.split_once('=').unwrap();
                vars.insert(k["TORCHTOOLS_JOB_".len()..].to_owned(), v.to_owned());
            }
            (Some(i), l) => {
                i.push_str(l);
                i.push('\n');
            }
        }
    }
    if let Some(i) = input {
        runs.push((vars, i));
    }
    runs
}

/// Whether a guardian of `id` (the process that runs its hook) still runs.
fn guardian_runs(id: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
            let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"job-hook" && w[1] == id.as_bytes())
        })
    })
}

/// Waits until the hook of `name` has run and its guardian has ended, then returns
/// every run it recorded (exactly once means one).
fn after_hook(dir: &Path, name: &str) -> Vec<(BTreeMap<String, String>, String)> {
    until(&format!("the hook of {name} runs"), || {
        !runs(dir, name).is_empty()
    });
    until(&format!("the guardian of {name} ends"), || {
        !guardian_runs(name)
    });
    runs(dir, name)
}

fn log_of(dir: &Path, id: &str) -> PathBuf {
    dir.join("state/torchtools/logs").join(format!("{id}.log"))
}

fn user() -> String {
    ok(Command::new("id").arg("-un").output().unwrap())
        .trim()
        .to_owned()
}

#[test]
fn a_detached_jobs_hook_runs_once_however_it_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let hook = recorder(dir);
    let start = |gpu: &str, extra: &[&str], script: &str| {
        let mut args = vec!["reserve", "--detach", "--on-end", &hook];
        args.extend(extra);
        args.extend(["--gpu", gpu, "--no-fence", "--", "sh", "-c", script]);
        detach(dir, &args)
    };
    let ready = |id: &str| {
        until(&format!("{id} is ready"), || {
            std::fs::read_to_string(log_of(dir, id)).is_ok_and(|l| l.contains("ready"))
        })
    };

    // Exit 0 and exit 3: the status, the state, every variable, the log's last 50
    // lines on standard input.
    let fine = start("0", &[], "echo all good");
    let failed = start("1", &[], "seq 1 80; exit 3");
    let cancelled = start("2", &["--after-ok", &failed], "echo never");
    // A stopped job, and a job whose keeper is killed with SIGKILL (lost).
    let stopped = start("3", &[], "echo ready; exec sleep 600");
    let lost = start("4", &[], "echo ready; exec sleep 600");
    ready(&stopped);
    // A generous grace: on a busy machine the job must end by SIGTERM, never SIGKILL.
    let out = tt(dir)
        .args(["stop", &stopped, "--grace", "120s"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    ready(&lost);
    let job: serde_json::Value =
        serde_json::from_str(&ok(tt(dir).args(["jobs", "--json"]).output().unwrap())).unwrap();
    let keeper = job
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == lost.as_str())
        .unwrap()["keeper_pid"]
        .as_i64()
        .unwrap() as i32;
    // SAFETY: kill(2) of our own detached job's keeper (alone: its job goes on).
    unsafe { libc::kill(keeper, libc::SIGKILL) };

    let me = user();
    for (id, gpu, status, state) in [
        (&fine, "0", "0", "finished".to_owned()),
        (&failed, "1", "3", "failed (3)".to_owned()),
        (
            &cancelled,
            "",
            "",
            format!("cancelled: job {failed} failed"),
        ),
        (&stopped, "3", "143", "killed by signal 15".to_owned()),
        (&lost, "4", "", "lost (its keeper was killed)".to_owned()),
    ] {
        let runs = after_hook(dir, id);
        assert_eq!(runs.len(), 1, "{id}: the hook ran {} times", runs.len());
        let (vars, input) = &runs[0];
        assert_eq!(vars["ID"], *id, "{vars:?}");
        assert_eq!(vars["STATUS"], status, "{id}: {vars:?}");
        assert_eq!(vars["STATE"], state, "{id}: {vars:?}");
        assert_eq!(vars["GPUS"], gpu, "{id}: {vars:?}");
        assert_eq!(vars["USER"], me, "{vars:?}");
        assert_eq!(Path::new(&vars["LOG"]), log_of(dir, id), "{vars:?}");
        // The command as the job runs it, without the hook (a secret stays out of
        // the record everyone reads).
        assert!(
            vars["COMMAND"].starts_with("torchtools reserve --gpu ")
                && vars["COMMAND"].contains(" -- sh -c '")
                && !vars["COMMAND"].contains("on-end"),
            "{vars:?}"
        );
        let started: u64 = vars["STARTED"].parse().unwrap();
        let ended: u64 = vars["ENDED"].parse().unwrap();
        assert!(started <= ended, "{vars:?}");
        if *id == failed {
            let expected: String = (31..=80).map(|i| format!("{i}\n")).collect();
            assert_eq!(*input, expected, "the log's last 50 lines");
        }
        if *id == fine {
            assert!(input.contains("all good\n"), "{input}");
        }
    }
    // The lost job's command still runs (only its keeper was killed): end it.
    let sid = keeper;
    // SAFETY: kill(2) of the session our detached job led.
    unsafe { libc::kill(-sid, libc::SIGKILL) };
}

#[test]
fn a_failing_or_hanging_hook_never_changes_the_jobs_status() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let pid_file = dir.join("hook.pid");
    let hanging = format!(
        "sleep 600 & echo $! > {}; echo hook started; wait",
        pid_file.display()
    );
    let failing = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--on-end",
            "exit 7",
            "--gpu",
            "0",
            "--no-fence",
            "--",
            "true",
        ],
    );
    let hung = detach(
        dir,
        &[
            "reserve",
            "--detach",
            "--on-end",
            &hanging,
            "--on-end-timeout",
            "1s",
            "--gpu",
            "1",
            "--no-fence",
            "--",
            "sh",
            "-c",
            "exit 4",
        ],
    );
    let out = tt(dir)
        .args(["jobs", "wait", &failing, &hung])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    for (id, said) in [
        (
            &failing,
            "the --on-end hook `exit 7` failed (exit 7)".to_owned(),
        ),
        (
            &hung,
            "still ran after 1s: killed (--on-end-timeout)".to_owned(),
        ),
    ] {
        until(&format!("{id}'s hook is done"), || !guardian_runs(id));
        let log = std::fs::read_to_string(log_of(dir, id)).unwrap();
        assert!(
            log.contains(&said) && log.contains("the job's status is unchanged"),
            "{log}"
        );
    }
    let all: serde_json::Value =
        serde_json::from_str(&ok(tt(dir).args(["jobs", "--json"]).output().unwrap())).unwrap();
    let status = |id: &str| {
        all.as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == id)
            .unwrap()["status"]
            .clone()
    };
    assert_eq!(status(&failing), 0);
    assert_eq!(status(&hung), 4);
    // The hanging hook was killed whole: what it started too.
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    until("the hook's sleep is gone", || {
        // SAFETY: kill(2) with signal 0 only asks whether the process exists.
        unsafe { libc::kill(pid, 0) != 0 }
    });
}

#[test]
fn an_attached_jobs_hook_runs_once_before_torchtools_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let hook = recorder(dir);
    // reserve, run and launch, each with its status.
    let cases: [(&[&str], i32, &str); 3] = [
        (
            &[
                "reserve",
                "--gpu",
                "0",
                "--no-fence",
                "--",
                "sh",
                "-c",
                "exit 3",
            ],
            3,
            "0",
        ),
        (
            &[
                "run",
                "--bytes",
                "1GiB",
                "--no-fence",
                "--gpu",
                "1",
                "--",
                "true",
            ],
            0,
            "1",
        ),
        (
            &[
                "launch",
                "--nproc-per-node",
                "2",
                "--gpu",
                "2",
                "--no-fence",
                "--",
                "sh",
                "-c",
                "exit 5",
            ],
            5,
            "2",
        ),
    ];
    for (n, (args, status, gpu)) in cases.into_iter().enumerate() {
        let out = tt(dir)
            .args(&args[..1])
            .args(["--on-end", &hook])
            .args(&args[1..])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(status), "{out:?}");
        // Already run when torchtools returned: no waiting.
        let runs = runs(dir, "attached");
        assert_eq!(runs.len(), n + 1, "{runs:?}");
        let vars = &runs[n].0;
        assert_eq!(vars["STATUS"], status.to_string(), "{vars:?}");
        assert_eq!(vars["GPUS"], gpu, "{vars:?}");
        assert_eq!(vars["ID"], "", "{vars:?}");
        assert_eq!(vars["LOG"], "", "{vars:?}");
        assert!(
            vars["COMMAND"].starts_with(&format!("torchtools {}", args[0]))
                && !vars["COMMAND"].contains("on-end"),
            "{vars:?}"
        );
    }

    // torchtools killed with SIGKILL while its command runs: the job is lost, and the
    // hook says so, once.
    std::fs::remove_file(dir.join("hooks/attached")).unwrap();
    let ready = dir.join("ready");
    let mut job = tt(dir)
        .args([
            "reserve",
            "--on-end",
            &hook,
            "--gpu",
            "0",
            "--no-fence",
            "--",
        ])
        .args([
            "sh",
            "-c",
            &format!("touch {}; exec sleep 600", ready.display()),
        ])
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    until("the command runs", || ready.exists());
    job.kill().unwrap();
    job.wait().unwrap();
    let runs = after_hook(dir, "attached");
    // SAFETY: kill(2) of the process group the test started (the orphaned command).
    unsafe { libc::kill(-(job.id() as i32), libc::SIGKILL) };
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].0["STATE"], "lost (torchtools was killed)");
    assert_eq!(runs[0].0["STATUS"], "");
    assert_eq!(runs[0].0["GPUS"], "0");
}

#[test]
fn the_configs_hook_is_the_default_and_a_bad_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let config = dir.join("config/torchtools/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    std::fs::write(
        &config,
        format!(
            "[on_end]\ncommand = '''{}'''\ntimeout = \"30s\"\n",
            recorder(dir)
        ),
    )
    .unwrap();
    let reserve = |extra: &[&str]| {
        tt(dir)
            .arg("reserve")
            .args(extra)
            .args(["--gpu", "0", "--no-fence", "--", "true"])
            .output()
            .unwrap()
    };
    ok(reserve(&[]));
    assert_eq!(runs(dir, "attached").len(), 1);
    ok(reserve(&["--no-on-end"]));
    assert_eq!(runs(dir, "attached").len(), 1, "--no-on-end ran the hook");
    // A detached job runs it once, from its keeper (not once more from its torchtools).
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
    assert_eq!(after_hook(dir, &id).len(), 1);

    // A misspelt key: refused before the command runs, naming the file and the fix.
    std::fs::write(&config, "[on_end]\ncomand = \"true\"\n").unwrap();
    let ran = dir.join("ran");
    let out = tt(dir)
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "touch"])
        .arg(&ran)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&config.display().to_string()) && err.contains("comand"),
        "{err}"
    );
    assert!(!ran.exists(), "the command ran despite a bad config");
}
