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
    assert!(json["nvml_peak"].as_u64().unwrap() >= 2 << 30, "{json}");
}

#[test]
fn one_lock_per_gpu_whatever_form_names_it() {
    let uuid = require_gpu();
    let tmp = tempfile::tempdir().unwrap();
    let mut holder = torchtools()
        .env("TORCHTOOLS_LOCK_DIR", tmp.path())
        .args(["reserve", "--gpu", "0", "--no-fence", "--", "sh", "-c"])
        .arg("echo held; cat > /dev/null")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tt_testkit::wait_for_line(
        holder.stdout.take().unwrap(),
        "held",
        std::time::Duration::from_secs(120),
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
