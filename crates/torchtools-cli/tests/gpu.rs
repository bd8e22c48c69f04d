//! GPU tests of `torchtools reserve` (`cargo xtask test-gpu`): the fence seen from the
//! command it runs, and two reserves of one GPU taking turns. The binary is
//! `TORCHTOOLS_BIN` when set (the GPU bundle), else the one cargo built.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};

fn torchtools() -> Command {
    let bin = std::env::var("TORCHTOOLS_BIN").unwrap_or(env!("CARGO_BIN_EXE_torchtools").into());
    let mut cmd = Command::new(bin);
    cmd.env_remove("CUDA_VISIBLE_DEVICES");
    cmd
}

fn require_gpu() -> String {
    let inv = tt_device::Inventory::query();
    assert!(!inv.gpus.is_empty(), "GPU tests need a GPU: {:?}", inv.nvml);
    inv.gpus[0].uuid.clone()
}

/// `torchtools reserve --gpu 0 --no-fence -- CMD` with the locks in `locks`, once CMD
/// has printed `ready` (it runs until its standard input closes).
fn hold_gpu_0(locks: &std::path::Path, cmd: &[&str], ready: &str) -> std::process::Child {
    let mut holder = torchtools()
        .env("TORCHTOOLS_LOCK_DIR", locks)
        .args(["reserve", "--gpu", "0", "--no-fence", "--"])
        .args(cmd)
        .env_remove("PYTHONUNBUFFERED")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tt_testkit::wait_for_line(
        holder.stdout.take().unwrap(),
        ready,
        std::time::Duration::from_secs(120),
    );
    holder
}

#[test]
fn the_command_sees_the_fence_leave_its_bytes_free() {
    let uuid = require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let out = torchtools()
        .env("TORCHTOOLS_LOCK_DIR", tmp.path())
        .args(["reserve", "--gpu", "0", "--bytes", "4GiB", "--", "sh", "-c"])
        .arg("echo $CUDA_VISIBLE_DEVICES; nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i $CUDA_VISIBLE_DEVICES")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = text.lines();
    assert_eq!(lines.next().unwrap(), uuid);
    let free_mib: u64 = lines.next().unwrap().trim().parse().unwrap();
    // 4 GiB + the 50 MiB margin, within 256 MiB of driver bookkeeping.
    assert!(
        free_mib.abs_diff(4096 + 50) < 256,
        "{free_mib} MiB free in the command"
    );
}

#[test]
fn two_reserves_of_one_gpu_take_turns() {
    require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log");
    let script = format!(
        "echo start >> {0}; sleep 0.5; echo end >> {0}",
        log.display()
    );
    let spawn = || {
        torchtools()
            .env("TORCHTOOLS_LOCK_DIR", tmp.path())
            .args([
                "reserve", "--gpu", "0", "--bytes", "8GiB", "--", "sh", "-c", &script,
            ])
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (spawn(), spawn());
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "start\nend\nstart\nend\n"
    );
}

#[test]
fn probe_of_a_python_command_sees_its_2_gib_on_cuda() {
    require_gpu();
    let python = tt_testkit::python_path();
    let out = torchtools()
        .args(["probe", "--json", "--", &python, "-c"])
        .arg("import torch, time; x = torch.ones(2 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); time.sleep(0.5)")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["memory"], "gpu", "{json}");
    // The command's own memory: its 2 GiB and PyTorch's CUDA context (under 1.5 GiB),
    // not the whole GPU's use.
    let peak = json["nvml_peak"].as_u64().unwrap();
    assert!(
        (2 << 30..(7 << 29)).contains(&peak),
        "peak {peak} bytes: {json}"
    );
}

/// A Python command holding 2 GiB on the GPU and computing for about a second.
const PY_GPU_WORK: &str = "import torch, time, sys\n\
    x = torch.ones(2 << 30, dtype=torch.uint8, device='cuda')\n\
    a = torch.randn(4096, 4096, device='cuda')\n\
    t = time.time()\n\
    while time.time() - t < 1.0:\n\
    \x20   a = (a @ a).clamp_(-1, 1)\n\
    torch.cuda.synchronize()\n\
    print('ready', flush=True)\n\
    sys.stdin.read()\n";

#[test]
fn track_reports_the_commands_gpu_memory_and_use() {
    require_gpu();
    let python = tt_testkit::python_path();
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("report.json");
    // The report to a file: the command's own output shares stdout.
    let out = torchtools()
        .args([
            "track",
            "--format",
            "json",
            "--gru",
            "bytes",
            "--interval",
            "50ms",
        ])
        .arg("--output")
        .arg(&report)
        .args(["--", python.as_str(), "-c", PY_GPU_WORK])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&report).unwrap();
    let r: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let gpu_ram = &r["max_gpu_ram"];
    let main = gpu_ram["main"].as_f64().unwrap_or(0.0);
    // The command's 2 GiB and its CUDA context, not the whole GPU.
    assert!(
        ((2u64 << 30) as f64..(7u64 << 29) as f64).contains(&main),
        "main GPU RAM {main}: {r}"
    );
    assert!(gpu_ram["system"].as_f64().unwrap_or(0.0) >= main, "{r}");
    let busy = r["gpu_utilization"]["gpu_percentages"]["max_sum_percent"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(busy > 0.0, "a second of matrix products, no GPU use: {r}");
}

#[test]
fn top_shows_the_gpu_its_holder_and_the_process_inside_the_reservation() {
    let uuid = require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let python = tt_testkit::python_path();
    let mut holder = hold_gpu_0(tmp.path(), &[&python, "-c", PY_GPU_WORK], "ready");
    let top = |args: &[&str]| {
        let out = torchtools()
            .env("TORCHTOOLS_LOCK_DIR", tmp.path())
            .env("COLUMNS", "200")
            .args(["top"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let json: serde_json::Value = serde_json::from_str(&top(&["--json"])).unwrap();
    let once = top(&["--once"]);
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());

    assert_eq!(json["nvml"]["status"], "available", "{json}");
    let gpus = json["gpus"].as_array().unwrap();
    let gpu = gpus
        .iter()
        .find(|g| g["index"] == 0)
        .unwrap_or_else(|| panic!("no GPU 0: {json}"));
    let used = gpu["used"].as_u64().unwrap_or(0);
    assert!(used >= 2 << 30, "GPU 0 uses {used} bytes: {gpu}");
    assert!(gpu["total"].as_u64().unwrap_or(0) > used, "{gpu}");
    assert!(!gpu["holder"].is_null(), "the reservation's holder: {gpu}");
    let procs = gpu["processes"].as_array().unwrap();
    let worker = procs
        .iter()
        .find(|p| p["used"].as_u64().unwrap_or(0) >= 2 << 30)
        .unwrap_or_else(|| panic!("the Python process is not listed: {gpu}"));
    assert_eq!(worker["in_reservation"], true, "{worker}");
    assert!(
        worker["command"].as_str().unwrap_or("").contains("python"),
        "{worker}"
    );
    let name = gpu["name"].as_str().unwrap();
    assert!(
        once.contains(name),
        "top --once does not show {name}:\n{once}"
    );
    println!("{uuid}: {once}");
}

#[test]
fn one_lock_per_gpu_whatever_form_names_it() {
    let uuid = require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let mut holder = hold_gpu_0(
        tmp.path(),
        &["sh", "-c", "echo held; cat > /dev/null"],
        "held",
    );
    let prefix = &uuid[..12];
    // (CUDA_VISIBLE_DEVICES, --gpu): every one names the GPU the holder has.
    let forms: [(Option<&str>, &str); 9] = [
        (None, "0"),
        (None, &uuid),
        (None, prefix),
        (None, "cuda:0"),
        (None, "auto"),
        (Some("0"), "cuda:0"),
        (Some(&uuid), "cuda:0"),
        (Some(prefix), "cuda:0"),
        (Some(&uuid), "auto"),
    ];
    let attempt = |visible: Option<&str>, gpu: &str| {
        let mut cmd = torchtools();
        if let Some(v) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        cmd.env("TORCHTOOLS_LOCK_DIR", tmp.path())
            .args([
                "reserve",
                "--gpu",
                gpu,
                "--no-fence",
                "--timeout",
                "1s",
                "--",
                "true",
            ])
            .output()
            .unwrap()
    };
    for (visible, gpu) in forms {
        let out = attempt(visible, gpu);
        assert_eq!(
            out.status.code(),
            Some(75),
            "CUDA_VISIBLE_DEVICES={visible:?} --gpu {gpu}: the GPU is held, yet {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    let out = attempt(Some(&uuid), "cuda:0");
    assert!(
        out.status.success(),
        "once released: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 33: a container's `track` (a PID namespace of its own, `/proc` mounted there)
/// attributes the command's 2 GiB to it. The NVIDIA driver translates the PIDs NVML
/// lists into the caller's namespace (seen with driver 580), so the tracker's PIDs and
/// NVML's agree inside the container.
#[test]
fn track_inside_a_pid_namespace_sees_the_commands_2_gib() {
    require_gpu();
    let python = tt_testkit::python_path();
    let bin = std::env::var("TORCHTOOLS_BIN").unwrap_or(env!("CARGO_BIN_EXE_torchtools").into());
    let tmp = tempfile::tempdir().unwrap();
    let report = tmp.path().join("report.json");
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", &bin])
        .args(["track", "--format", "json", "--gru", "bytes", "--output"])
        .arg(&report)
        .args(["--", python.as_str(), "-c", PY_GPU_WORK])
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "unshare (root needed) or track failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&report).unwrap();
    let r: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let main = r["max_gpu_ram"]["main"].as_f64().unwrap_or(0.0);
    assert!(
        ((2u64 << 30) as f64..(7u64 << 29) as f64).contains(&main),
        "main GPU RAM {main} inside the PID namespace: {r}"
    );
}

/// A Python job of a shared reservation: allocates `GIB` GiB, prints `ready` (or the
/// out-of-memory error's first words), then waits for its standard input to close.
const PY_SHARE_JOB: &str = "import torch, sys, os\n\
    n = int(float(sys.argv[1]) * (1 << 30))\n\
    try:\n\
    \x20   x = torch.empty(n, dtype=torch.uint8, device='cuda')\n\
    \x20   torch.cuda.synchronize()\n\
    \x20   print('ready', os.environ.get('TORCHTOOLS_SHARE_FRACTION'), flush=True)\n\
    except torch.OutOfMemoryError as e:\n\
    \x20   print('oom', flush=True)\n\
    sys.stdin.read()\n";

/// Issue 33: two jobs of a quarter of the card each (20 GiB of an H100's 80) share it
/// at once while a job asking for three quarters waits (1/4 + 1/4 + 3/4 > 1) and is
/// served when they leave; a Python process outside any reservation cannot allocate
/// the memory no sharer budgeted (the fence); a sharer's PyTorch cannot grow past its
/// budget; `locks` shows the two sharers. Every size is a fraction of the card it runs
/// on, so the test means the same on an 80 GiB H100 and a 141 GiB H200.
#[test]
fn two_20_gib_sharers_run_together_while_a_60_gib_share_waits() {
    require_gpu();
    let total = tt_device::Inventory::query().gpus[0].total.0;
    // `part` of the card: as bytes for --bytes, as GiB for the job's allocation.
    let bytes = |part: f64| format!("{}", (total as f64 * part) as u64);
    let gib = |part: f64| format!("{}", total as f64 * part / (1u64 << 30) as f64);
    let python = tt_testkit::python_path();
    let tmp = tempfile::tempdir().unwrap();
    let locks = tmp.path();
    let share = |budget: &str, alloc: &str| {
        let mut child = torchtools()
            .env("TORCHTOOLS_LOCK_DIR", locks)
            .args(["reserve", "--gpu", "0", "--share", "--bytes", budget, "--"])
            .args([python.as_str(), "-c", PY_SHARE_JOB, alloc])
            .env_remove("PYTHONUNBUFFERED")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut first,
        )
        .unwrap();
        (child, first)
    };
    let (a, a_says) = share(&bytes(0.25), &gib(0.225));
    let (b, b_says) = share(&bytes(0.25), &gib(0.225));
    assert!(a_says.starts_with("ready 0.25"), "{a_says}");
    assert!(b_says.starts_with("ready"), "{b_says}");
    // Both hold 18 GiB now, side by side.
    let listed = torchtools()
        .env("TORCHTOOLS_LOCK_DIR", locks)
        .arg("locks")
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(listed.contains("shared by 2 job(s)"), "{listed}");
    // Outside any reservation, a tenth of the card, of the half no sharer budgeted:
    // fenced.
    let outsider = Command::new(&python)
        .args(["-c", PY_SHARE_JOB, &gib(0.1)])
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let says = String::from_utf8_lossy(&outsider.stdout).into_owned();
    assert_eq!(
        says.trim(),
        "oom",
        "an outsider allocated a tenth of the card beside two sharers"
    );
    // A sharer's allocator is capped at its budget: an eighth of the card fits in the
    // ledger, 7/40 of it in tensors do not fit in the budget.
    let (mut c, c_says) = share(&bytes(0.125), &gib(0.175));
    assert_eq!(
        c_says.trim(),
        "oom",
        "a share of 1/8 allocated 7/40 of the card"
    );
    drop(c.stdin.take());
    assert!(c.wait().unwrap().success());
    // Three quarters do not fit beside a half: it waits, and gives up at its timeout.
    let waited = torchtools()
        .env("TORCHTOOLS_LOCK_DIR", locks)
        .args(["reserve", "--gpu", "0", "--share", "--bytes", &bytes(0.75)])
        .args(["--timeout", "3s", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(
        waited.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&waited.stderr)
    );
    for mut job in [a, b] {
        drop(job.stdin.take());
        assert!(job.wait().unwrap().success());
    }
    let (mut d, d_says) = share(&bytes(0.75), &gib(0.625));
    assert!(d_says.starts_with("ready"), "{d_says}");
    drop(d.stdin.take());
    assert!(d.wait().unwrap().success());
}
