//! `torchtools launch` with real processes.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("launch")
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .unwrap()
}

#[test]
fn every_rank_gets_torchruns_variables_and_a_prefix() {
    let out = launch(&[
        "--nproc-per-node", "3", "--", "sh", "-c",
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{text}");
    let port = lines[0].split(' ').nth(6).unwrap().to_owned();
    assert!(port.parse::<u16>().is_ok(), "{text}");
    for (rank, line) in lines.iter().enumerate() {
        assert_eq!(
            *line,
            format!("[rank{rank}]: {rank} 3 {rank} 3 127.0.0.1 {port} 1")
        );
    }
}

#[test]
fn a_failed_rank_stops_the_others_and_is_named() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then sleep 0.2; exit 3; else exec sleep 600; fi",
    ]);
    assert_eq!(out.status.code(), Some(3));
    // Rank 0 would sleep ten minutes: ended well before, it was stopped (a generous
    // bound, far from both, whatever the machine's load).
    assert!(
        start.elapsed() < Duration::from_secs(300),
        "{:?}",
        start.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1 exited with status 3"), "{err}");
}

#[test]
fn the_group_is_restarted_up_to_max_restarts() {
    let script =
        "if [ $TORCHELASTIC_RESTART_COUNT -lt 1 ] && [ $RANK = 0 ]; then exit 5; fi; echo ok";
    let out = launch(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("restarting the group (1/1)"));
    let out = launch(&["--nproc-per-node", "2", "--", "sh", "-c", "exit 5"]);
    assert_eq!(out.status.code(), Some(5));
    let out = launch(&["--nnodes", "2", "--node-rank", "2", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank 2"));
}

#[test]
fn omp_num_threads_is_set_to_1_only_when_unset() {
    // Unset (above): 1 per rank, as torchrun does. Set by the user: theirs, untouched.
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo omp=$OMP_NUM_THREADS",
        ])
        .env("OMP_NUM_THREADS", "3")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.matches("omp=3").count(), 2, "{text}");
}

/// A Python rank's `print`, without flush, shows while the rank runs, as it does under
/// torchrun (whose ranks write to the terminal): ours write into a pipe, where Python
/// would hold the line back until it exits. The rank waits for a file that the test
/// creates only once it has seen the line. PYTHONUNBUFFERED is unset, as on most users'
/// machines.
#[test]
fn a_python_ranks_print_shows_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = "import os, sys, time\n\
                  print('step 1 done')\n\
                  t = time.time()\n\
                  while not os.path.exists(sys.argv[1]) and time.time() - t < 300:\n\
                  \x20   time.sleep(0.05)\n\
                  print('finished')\n";
    let mut child = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("launch")
        .args(["--nproc-per-node", "1", "--"])
        .arg(tt_testkit::python_path())
        .args(["-c", script])
        .arg(&go)
        .env_remove("PYTHONUNBUFFERED")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let line = tt_testkit::wait_for_line(
        child.stdout.take().unwrap(),
        "step 1 done",
        Duration::from_secs(120),
    );
    assert_eq!(line, "[rank0]: step 1 done");
    std::fs::write(&go, "").unwrap();
    assert!(child.wait().unwrap().success());
}

/// More ranks than a node runs is refused before anything starts (it used to start
/// processes until the machine ran out, then panic), with the limit named.
#[test]
fn too_many_ranks_are_refused_before_any_starts() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let out = launch(&[
        "--nproc-per-node",
        "100000",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most 1024 ranks per node"), "{err}");
    assert!(!marker.exists(), "a rank started");
}

/// A `CUDA_VISIBLE_DEVICES` that CUDA would misread is the same error for `launch` as
/// for `reserve` (it used to count as "no GPU": `auto` then ran CPU ranks), and nothing
/// starts.
#[test]
fn a_bad_cuda_visible_devices_is_refused_by_launch_before_any_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    for nproc in ["auto", "gpu"] {
        let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
            .args(["launch", "--nproc-per-node", nproc, "--", "touch"])
            .arg(&marker)
            .env("CUDA_VISIBLE_DEVICES", "0,x")
            .env_remove("TORCHTOOLS_HELD_LOCKS")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{nproc}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("CUDA_VISIBLE_DEVICES=\"0,x\" has the entry \"x\""),
            "{nproc}: {err}"
        );
        assert!(!marker.exists(), "a rank started");
    }
}

/// A command that cannot start exits as in a shell and the other commands: 127 when it
/// is not found (a script too), 126 when it is not executable; a `.py` script runs with
/// Python, as under torchrun.
#[test]
fn a_command_that_cannot_start_exits_127_or_126_and_a_script_runs_with_python() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.py");
    std::fs::write(&script, "print('hi')\n").unwrap();
    let out = launch(&["--nproc-per-node", "2", "--", "no-such-command-here"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found on PATH"));
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_torchtools"))
            .current_dir(dir.path())
            .arg("launch")
            .args(args)
            .output()
            .unwrap()
    };
    for form in [
        &["--", "train.py"][..],
        &["train.py"],
        &["--nproc_per_node=2", "train.py"],
    ] {
        let out = run(form);
        assert!(out.status.success(), "{form:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("[rank0]: hi"),
            "{out:?}"
        );
    }
    let out = run(&["missing.py"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such script: missing.py"));
    let out = launch(&["--no-python", "--", script.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(126), "{out:?}");
}

/// The torch-related variables a rank sees, as JSON in `$ENV_OUT/RANK.json` (a file
/// each: under torchrun the ranks share one stdout, where their lines can interleave).
const ENV_DUMP: &str = "import os, json\n\
    keys = [k for k in os.environ if k.startswith(('TORCH', 'ROLE_', 'GROUP_', 'LOCAL_', \
    'RANK', 'WORLD_', 'MASTER_', 'OMP_'))]\n\
    path = os.path.join(os.environ['ENV_OUT'], os.environ['RANK'] + '.json')\n\
    open(path, 'w').write(json.dumps({k: os.environ[k] for k in keys}))\n";

/// Each rank's variables (by RANK), from the files a launch's ranks wrote in `dir`.
fn rank_envs(
    out: &Output,
    dir: &std::path::Path,
) -> std::collections::BTreeMap<String, serde_json::Value> {
    assert!(out.status.success(), "{out:?}");
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|f| {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(f.path()).unwrap()).unwrap();
            (v["RANK"].as_str().unwrap().to_owned(), v)
        })
        .collect()
}

/// torchrun and `torchtools launch` on the same script with torchrun's published
/// command-line forms: the same ranks, the same variables (as sets), the same values
/// where they are the rank's.
#[test]
fn torchruns_command_lines_give_the_ranks_torchruns_variables() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dump.py"), ENV_DUMP).unwrap();
    std::fs::create_dir(dir.path().join("pkg")).unwrap();
    std::fs::write(dir.path().join("pkg/__init__.py"), "").unwrap();
    std::fs::write(dir.path().join("pkg/dump.py"), ENV_DUMP).unwrap();
    let python = std::path::PathBuf::from(tt_testkit::python_path());
    let bin = python.parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |program: &std::path::Path, args: &[&str]| {
        let out_dir = tempfile::tempdir().unwrap();
        let out = Command::new(program)
            .current_dir(dir.path())
            .args(args)
            .env("PATH", &path)
            .env("PYTHONPATH", dir.path())
            .env("ENV_OUT", out_dir.path())
            .env_remove("OMP_NUM_THREADS")
            .env_remove("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            .output()
            .unwrap();
        rank_envs(&out, out_dir.path())
    };
    let ours = std::path::Path::new(env!("CARGO_BIN_EXE_torchtools"));
    // torchrun's static rendezvous serves its store on 29500 unless told: a free port
    // instead, so that nothing else on the machine (another test run) collides with it.
    let port = || {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("--master-port={}", free.local_addr().unwrap().port())
    };
    let (p1, p2) = (port(), port());
    for form in [
        &["--nproc_per_node=2", "--standalone", "dump.py"][..],
        &["--nproc-per-node", "2", &p1, "-m", "pkg.dump"],
        &[
            "--nnodes=1",
            "--nproc_per_node",
            "2",
            &p2,
            "--run-path",
            "dump.py",
        ],
    ] {
        let theirs = run(&bin.join("torchrun"), form);
        let mut args = vec!["launch"];
        args.extend_from_slice(form);
        let mine = run(ours, &args);
        assert_eq!(theirs.len(), 2, "{form:?}: {theirs:?}");
        assert_eq!(
            theirs.keys().collect::<Vec<_>>(),
            mine.keys().collect::<Vec<_>>(),
            "{form:?}"
        );
        for (rank, t) in &theirs {
            let m = &mine[rank];
            let keys = |v: &serde_json::Value| {
                v.as_object()
                    .unwrap()
                    .keys()
                    .cloned()
                    .collect::<std::collections::BTreeSet<_>>()
            };
            assert_eq!(keys(t), keys(m), "{form:?} rank {rank}");
            for same in [
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "ROLE_NAME",
                "ROLE_RANK",
                "ROLE_WORLD_SIZE",
                "OMP_NUM_THREADS",
                "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            ] {
                assert_eq!(t[same], m[same], "{form:?} rank {rank}: {same}");
            }
            // Our ranks' error files exist to be written (their directory does).
            let file = std::path::PathBuf::from(m["TORCHELASTIC_ERROR_FILE"].as_str().unwrap());
            assert!(
                file.ends_with(format!("attempt_0/{rank}/error.json")),
                "{file:?}"
            );
        }
    }
}

/// A rank that fails in a function wrapped in PyTorch's `@record`: the summary names
/// the exception and its line, from the rank's TORCHELASTIC_ERROR_FILE.
#[test]
fn the_failure_summary_names_the_recorded_exception() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("fail.py"),
        "from torch.distributed.elastic.multiprocessing.errors import record\n\
         import os\n\
         @record\n\
         def main():\n\
         \x20   if os.environ['RANK'] == '1':\n\
         \x20       raise ValueError('bad learning rate')\n\
         main()\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .current_dir(dir.path())
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            &tt_testkit::python_path(),
            "fail.py",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stderr.lines().last().unwrap_or_default();
    assert!(
        summary.contains("rank 1 exited with status 1: ValueError: bad learning rate (")
            && summary.contains("fail.py, line 6)"),
        "{stderr}"
    );
}

/// torchrun options with no equivalent are refused by name, before anything starts.
#[test]
fn torchrun_options_without_an_equivalent_are_refused_by_name() {
    for (args, named) in [
        (&["--tee", "3", "x.py"][..], "--tee"),
        (&["--log_dir", "/tmp/x", "x.py"], "--log-dir"),
        (&["--rdzv-backend", "etcd", "x.py"], "c10d"),
        (&["--nnodes", "1:4", "x.py"], "elastic"),
        (&["--standalone", "--nnodes", "2", "x.py"], "--standalone"),
    ] {
        let out = launch(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(named),
            "{args:?}: {out:?}"
        );
    }
}

/// `torchtools ARGS` with `locks` as its lock directory, inheriting no GPU or lock.
fn torchtools_in(locks: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_torchtools"));
    c.args(args)
        .env("TORCHTOOLS_LOCK_DIR", locks)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("TORCHTOOLS_HELD_LOCKS");
    c
}

/// `launch --gpu`: the group's GPUs are reserved through the queue before any rank
/// starts, every rank sees them (and uses cuda:LOCAL_RANK), `locks` names the launch's
/// command, another request waits for them, and they are free once the group ends.
#[test]
fn launch_reserves_its_gpus_for_the_group() {
    let locks = tempfile::tempdir().unwrap();
    let go = locks.path().join("go");
    let script = format!(
        "echo $CUDA_VISIBLE_DEVICES $LOCAL_RANK; while [ ! -e {} ]; do sleep 0.05; done",
        go.display()
    );
    let torchtools = |args: &[&str]| torchtools_in(locks.path(), args);
    let locks_text =
        || String::from_utf8_lossy(&torchtools(&["locks"]).output().unwrap().stdout).into_owned();
    let mut group = torchtools(&[
        "launch",
        "--gpu",
        "0,1",
        "--no-fence",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut out = std::io::BufReader::new(group.stdout.take().unwrap());
    let mut seen = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        seen.push(line.trim().to_owned());
    }
    seen.sort();
    assert_eq!(seen, ["[rank0]: 0,1 0", "[rank1]: 0,1 1"]);
    // Both GPUs held for the launch's command.
    let text = locks_text();
    assert_eq!(text.matches("held by pid").count(), 2, "{text}");
    assert!(text.contains("sh -c echo $CUDA_VISIBLE_DEVICES"), "{text}");
    // Another request for GPU 1 waits (here: gives up after its timeout, exit 75).
    let other = torchtools(&[
        "reserve",
        "--gpu",
        "1",
        "--no-fence",
        "--timeout",
        "1s",
        "--",
        "true",
    ])
    .output()
    .unwrap();
    assert_eq!(other.status.code(), Some(75), "{other:?}");
    std::fs::write(&go, "").unwrap();
    assert!(group.wait().unwrap().success());
    let text = locks_text();
    assert_eq!(text.matches(": free").count(), 2, "{text}");
    // A rank that fails ends the group, and every GPU of the launch goes back.
    let out = torchtools(&[
        "launch",
        "--gpu",
        "0,1",
        "--no-fence",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $LOCAL_RANK = 1 ]; then exit 3; fi; exec sleep 60",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let text = locks_text();
    assert_eq!(text.matches(": free").count(), 2, "{text}");
    // A bad request is refused before any rank starts: a fence needs --bytes.
    let out = torchtools(&[
        "launch",
        "--gpu",
        "0",
        "--nproc-per-node",
        "1",
        "--",
        "true",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// Two hosts whose names resolve to 127.0.0.1 (as this machine's does), no interface
/// variable set: each launcher names the interface that reaches the master, and Python
/// ranks on the two hosts all-reduce; a user's own setting is kept.
#[test]
fn ranks_on_two_hosts_connect_without_an_interface_variable() {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("if") else {
        return;
    };
    let torchtools = |i: usize, args: &[&str]| {
        let mut c = hosts.exec(i, env!("CARGO_BIN_EXE_torchtools"));
        c.args(args).env_remove("OMP_NUM_THREADS");
        c
    };
    let script = "import os, torch, torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  t = torch.tensor([float(dist.get_rank() + 1)])\n\
                  dist.all_reduce(t)\n\
                  print('sum', t.item(), os.environ.get('GLOO_SOCKET_IFNAME'))\n\
                  dist.destroy_process_group()\n";
    let python = tt_testkit::python_path();
    let node = |i: usize| {
        let rank = i.to_string();
        torchtools(
            i,
            &[
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                &rank,
                "--master-addr",
                "10.231.0.1",
                "--master-port",
                "29531",
                "--nproc-per-node",
                "1",
                "--",
                &python,
                "-c",
                script,
            ],
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
    };
    let children = [node(0), node(1)];
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| {
            tt_testkit::hang::within(Duration::from_secs(300), "a two-host launch", move || {
                c.wait_with_output().unwrap()
            })
        })
        .collect();
    for (i, out) in outs.iter().enumerate() {
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "host {i}: {stdout}\n{stderr}");
        let iface = hosts.interface(i);
        assert!(
            stdout.contains(&format!("sum 3.0 {iface}")),
            "host {i}: {stdout}"
        );
        assert!(
            stderr.contains(&format!("GLOO_SOCKET_IFNAME={iface}")),
            "host {i}: {stderr}"
        );
    }
    // A user's own interface is kept (a one-node launch at the same address).
    let out = torchtools(
        0,
        &[
            "launch",
            "--master-addr",
            "10.231.0.1",
            "--",
            "sh",
            "-c",
            "echo $GLOO_SOCKET_IFNAME",
        ],
    )
    .env("GLOO_SOCKET_IFNAME", "mine")
    .output()
    .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("[rank0]: mine"),
        "{out:?}"
    );
    // No interface reaches the master: said before any rank starts.
    let out = torchtools(
        1,
        &[
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.99.99.99",
            "--master-port",
            "29532",
            "--",
            "true",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no network interface"),
        "{out:?}"
    );
}

/// `torchtools launch` as node `i` of a job of two on the two hosts, rendezvous on host
/// 0's `port`.
fn node_launch(hosts: &tt_testkit::netns::TwoHosts, i: usize, port: &str) -> Command {
    let mut c = hosts.exec(i, env!("CARGO_BIN_EXE_torchtools"));
    c.args(["launch", "--nnodes", "2", "--node-rank", &i.to_string()])
        .args(["--master-addr", hosts.addr(0), "--master-port", port]);
    c
}

/// A job of two nodes on two "hosts" (network namespaces): each node's launcher with
/// `args` after the node flags, every rank running `python -c script` (or `sh -c`
/// when `script` starts with `sh:`); the two launchers' outputs and how long each ran.
fn two_node_job(
    hosts: &tt_testkit::netns::TwoHosts,
    port: &str,
    args: &[&str],
    script: &str,
    env: &[(&str, &str)],
) -> Vec<(Output, Duration)> {
    let python = tt_testkit::python_path();
    let (program, code) = match script.strip_prefix("sh:") {
        Some(sh) => ("sh".to_owned(), sh.to_owned()),
        None => (python, script.to_owned()),
    };
    let node = |i: usize| {
        let mut c = node_launch(hosts, i, port);
        c.args(args)
            .args(["--", &program, "-c", &code])
            .env_remove("OMP_NUM_THREADS")
            .env_remove("TORCHTOOLS_LOG")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let start = Instant::now();
        (c.spawn().unwrap(), start)
    };
    let children = [node(0), node(1)];
    children
        .into_iter()
        .map(|(c, start)| {
            tt_testkit::hang::within(Duration::from_secs(300), "a two-node job", move || {
                let out = c.wait_with_output().unwrap();
                (out, start.elapsed())
            })
        })
        .collect()
}

fn said(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// torchrun's all-reduce across two hosts of two ranks each, no interface variable.
#[test]
fn two_nodes_of_two_ranks_all_reduce() {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("fa") else {
        return;
    };
    let script = "import torch, torch.distributed as dist\n\
                  dist.init_process_group('gloo')\n\
                  t = torch.tensor([float(dist.get_rank() + 1)])\n\
                  dist.all_reduce(t)\n\
                  print('sum', t.item(), 'world', dist.get_world_size())\n\
                  dist.destroy_process_group()\n";
    for (i, (out, _)) in two_node_job(&hosts, "29541", &["--nproc-per-node", "2"], script, &[])
        .iter()
        .enumerate()
    {
        let text = said(out);
        assert!(out.status.success(), "node {i}: {text}");
        for local in 0..2 {
            let rank = 2 * i + local;
            assert!(
                text.contains(&format!("[rank{rank}]: sum 10.0 world 4")),
                "node {i}: {text}"
            );
        }
    }
}

/// A rank that fails on node 1 while node 0's rank waits at the rendezvous (which would
/// wait TORCHTOOLS_DIST_TIMEOUT, 300 s here): both launchers end at once with the
/// failed rank's status, naming it and its node.
#[test]
fn a_rank_failing_on_one_node_ends_every_node() {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("fb") else {
        return;
    };
    let script = "import os, sys, datetime, torch.distributed as dist\n\
                  if os.environ['GROUP_RANK'] == '1': sys.exit(3)\n\
                  dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=300))\n\
                  print('never here')\n";
    let ends = two_node_job(
        &hosts,
        "29542",
        &["--nproc-per-node", "1", "--max-restarts", "0"],
        script,
        &[("TORCHTOOLS_DIST_TIMEOUT", "300")],
    );
    for (i, (out, took)) in ends.iter().enumerate() {
        let text = said(out);
        assert_eq!(out.status.code(), Some(3), "node {i}: {text}");
        assert!(
            text.contains("rank 1 exited with status 3 on node 1"),
            "node {i}: {text}"
        );
        assert!(!text.contains("never here"), "node {i}: {text}");
        // Without one fate node 0 would wait for the rendezvous's 300 s.
        eprintln!("node {i} ended after {took:?}");
        assert!(*took < Duration::from_secs(120), "node {i} took {took:?}");
    }
}

/// `--max-restarts 1` and a rank of node 1 that fails once: every node's ranks start
/// again, together, and the job succeeds; a preempted rank (75) is passed on by every
/// node and never restarted.
#[test]
fn restarts_and_preemption_are_the_whole_jobs() {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("fc") else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let once = scratch.path().join("failed-once");
    let script = format!(
        "sh:echo attempt $TORCHELASTIC_RESTART_COUNT; \
         if [ $GROUP_RANK = 1 ] && [ ! -e {0} ]; then touch {0}; exit 4; fi; sleep 1",
        once.display()
    );
    let ends = two_node_job(
        &hosts,
        "29543",
        &["--nproc-per-node", "1", "--max-restarts", "1"],
        &script,
        &[],
    );
    for (i, (out, _)) in ends.iter().enumerate() {
        let text = said(out);
        assert!(out.status.success(), "node {i}: {text}");
        assert!(
            text.contains(&format!("[rank{i}]: attempt 0"))
                && text.contains(&format!("[rank{i}]: attempt 1")),
            "node {i}: {text}"
        );
        assert!(
            text.contains("rank 1 exited with status 4 on node 1")
                && text.contains("restarting the ranks of every node (1/1)"),
            "node {i}: {text}"
        );
    }
    let script = "sh:echo attempt $TORCHELASTIC_RESTART_COUNT; \
                  if [ $GROUP_RANK = 1 ]; then exit 75; fi";
    let ends = two_node_job(
        &hosts,
        "29544",
        &["--nproc-per-node", "1", "--max-restarts", "3"],
        script,
        &[],
    );
    for (i, (out, _)) in ends.iter().enumerate() {
        let text = said(out);
        assert_eq!(out.status.code(), Some(75), "node {i}: {text}");
        assert!(text.contains("was preempted"), "node {i}: {text}");
        assert!(!text.contains("attempt 1"), "node {i}: {text}");
    }
}

/// A node that never starts: node 0 fails at TORCHTOOLS_DIST_TIMEOUT naming it, and a
/// node whose node 0 never starts says where it looked.
#[test]
fn a_node_that_never_joins_fails_the_job_naming_it() {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("fd") else {
        return;
    };
    let alone = |node: usize, port: &str| {
        node_launch(&hosts, node, port)
            .args(["--", "sh", "-c", "echo started"])
            .env("TORCHTOOLS_DIST_TIMEOUT", "2s")
            .env_remove("TORCHTOOLS_LOG")
            .output()
            .unwrap()
    };
    let out = alone(0, "29545");
    let text = said(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("node(s) 1 never joined within 2s (TORCHTOOLS_DIST_TIMEOUT)"),
        "{text}"
    );
    assert!(!text.contains("started"), "no rank starts alone: {text}");
    let out = alone(1, "29546");
    let text = said(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("node 0's launcher at 10.231.0.1:29546 did not answer within 2s"),
        "{text}"
    );
}

/// A rank that is a shell running a long command: when another rank fails, stopping it
/// stops what it started too (its process group), so the launcher ends at once instead
/// of waiting for the command, and nothing is left running.
#[test]
fn stopping_a_rank_stops_what_it_started() {
    let start = Instant::now();
    let out = launch(&[
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 3; fi; sleep 601.25",
    ]);
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    // Without process groups the launcher waited for `sleep` (ten minutes) to close the
    // rank's output; a generous bound far from both.
    assert!(took < Duration::from_secs(300), "took {took:?}");
    let left = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| c == b"sleep\x00601.25\x00");
    assert!(!left, "the rank's sleep is still running");
}

/// `launch --gpu`: the ranks inherit the group's GPU locks (as `reserve`'s command
/// does), so a `kill -9` of the launcher leaves the GPU held while a rank runs; another
/// request waits until the last rank has ended.
#[test]
fn a_launch_killed_with_sigkill_keeps_its_gpu_while_a_rank_runs() {
    let locks = tempfile::tempdir().unwrap();
    let go = locks.path().join("go");
    let script = format!(
        "echo ready; while [ ! -e {} ]; do sleep 0.05; done",
        go.display()
    );
    let torchtools = |args: &[&str]| torchtools_in(locks.path(), args);
    let mut launcher = torchtools(&[
        "launch",
        "--gpu",
        "0",
        "--no-fence",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(launcher.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "[rank0]: ready");
    launcher.kill().unwrap(); // SIGKILL: the launcher alone, its rank runs on
    launcher.wait().unwrap();
    let held = || {
        let out = torchtools(&["locks"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).contains("held by pid")
    };
    assert!(held(), "the rank still runs: GPU 0 must stay held");
    let other = torchtools(&[
        "reserve",
        "--gpu",
        "0",
        "--no-fence",
        "--timeout",
        "1s",
        "--",
        "true",
    ])
    .output()
    .unwrap();
    assert_eq!(other.status.code(), Some(75), "{other:?}");
    // The rank ends: the GPU is free, and the next request gets it.
    std::fs::write(&go, "").unwrap();
    let patience = Instant::now();
    while held() {
        assert!(
            patience.elapsed() < Duration::from_secs(120),
            "GPU 0 still held 120 s after its rank was told to end"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let next = torchtools(&["reserve", "--gpu", "0", "--no-fence", "--", "true"])
        .output()
        .unwrap();
    assert!(next.status.success(), "{next:?}");
}

/// torch.distributed.launch's command line (torchhandy's launch line): `--use_env` and
/// `--master_port="N"` are taken; with `--local-rank-arg` each rank gets
/// `--local-rank=N` right after the program, before its own arguments, as PyTorch's
/// launcher put it without `--use_env`.
#[test]
fn torch_distributed_launchs_command_line_runs() {
    let script = "echo $LOCAL_RANK \"$@\"";
    let port = tt_dist::free_port("127.0.0.1").unwrap().to_string();
    let out = launch(&[
        "--nproc_per_node=2",
        &format!("--master_port={port}"),
        "--use_env",
        "--no-python",
        "sh",
        "-c",
        script,
        "main",
        "--synch",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    assert_eq!(lines, ["[rank0]: 0 --synch", "[rank1]: 1 --synch"]);
    let tmp = tempfile::tempdir().unwrap();
    let main = tmp.path().join("main.py");
    std::fs::write(
        &main,
        "import os, sys\nprint(os.environ['LOCAL_RANK'], *sys.argv[1:])\n",
    )
    .unwrap();
    let main = main.to_str().unwrap();
    let out = launch(&["--nproc-per-node", "2", "--local-rank-arg", main, "--synch"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    lines.sort();
    // After the script, before its own arguments.
    assert_eq!(
        lines,
        [
            "[rank0]: 0 --local-rank=0 --synch",
            "[rank1]: 1 --local-rank=1 --synch"
        ]
    );
    // As PyTorch's launcher: a program that is not a Python script takes no such flag.
    let out = launch(&[
        "--nproc-per-node",
        "1",
        "--local-rank-arg",
        "--no-python",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--local-rank-arg"),
        "{out:?}"
    );
}
