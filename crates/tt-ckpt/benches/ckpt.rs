//! `cargo bench -p tt-ckpt` (and `cargo xtask bench`): durable checkpoint writes
//! against `dd conv=fsync` and Python's `torch.save` + fsync + rename, into the same
//! directory, in one run; and the training stall of `save_async`.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines for
//! the xtask table.

use std::process::Command;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, CheckpointDir};

const GIB: f64 = (1u64 << 30) as f64;
const RUNS: usize = 3;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

const PYTHON: &str = r#"
import os, sys, time, torch
d = sys.argv[1]
tensors = {f"t{i}": torch.rand(64 << 20) for i in range(4)}  # 1 GiB of f32
times = []
for r in range(4):  # the first is a warm-up
    tmp, final = os.path.join(d, "py.pt.tmp"), os.path.join(d, "py.pt")
    t = time.perf_counter()
    torch.save(tensors, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(d, os.O_RDONLY); os.fsync(fd); os.close(fd)
    times.append(time.perf_counter() - t)
print(sorted(times[1:])[1])
"#;

fn main() {
    let root = tempfile::tempdir().expect("a temp dir");
    let dir = CheckpointDir::open(root.path().join("ckpt"))
        .expect("open")
        .keep_last(1);
    let tensors: Vec<Tensor> = (0..4)
        .map(|_| Tensor::rand([64 << 20], (Kind::Float, Device::Cpu)))
        .collect();
    let build = |step: u64| {
        let mut c = Checkpoint::new(step);
        for (i, t) in tensors.iter().enumerate() {
            c.add_tch(&format!("t{i}"), t).expect("host copy");
        }
        c
    };

    let dd_path = root.path().join("ckpt/dd.bin");
    let run_dd = || {
        let t = Instant::now();
        let status = Command::new("dd")
            .args([
                "if=/dev/zero",
                "bs=16M",
                "count=64",
                "conv=fsync",
                "status=none",
            ])
            .arg(format!("of={}", dd_path.display()))
            .status()
            .expect("dd");
        assert!(status.success());
        t.elapsed()
    };
    // Durable save: checksums, write, fsync, rename, directory fsync (host copy
    // excluded), alternating with dd after one warm-up of each: on a VM the first
    // touch of fresh memory (page cache included) costs several times a reuse.
    let (mut ours, mut dd) = (Vec::new(), Vec::new());
    for step in 0..=RUNS as u64 {
        let c = build(step);
        let t = Instant::now();
        dir.save(&c).expect("save");
        let ours_time = t.elapsed();
        let dd_time = run_dd();
        if step > 0 {
            ours.push(ours_time);
            dd.push(dd_time);
        }
    }
    let (ours, dd) = (median(ours), median(dd));
    let _ = std::fs::remove_file(&dd_path);

    // save_async: what the training loop waits for (host copy + hand-off) per GiB,
    // with the host buffers recycled by `dir.checkpoint` (after one warm-up save).
    let mut stalls = Vec::new();
    for step in 0..=RUNS as u64 {
        let t = Instant::now();
        let mut c = dir.checkpoint(100 + step);
        for (i, tensor) in tensors.iter().enumerate() {
            c.add_tch(&format!("t{i}"), tensor).expect("host copy");
        }
        dir.save_async(c).expect("save_async");
        let stall = t.elapsed();
        dir.wait().expect("the background save");
        if step > 0 {
            stalls.push(stall);
        }
    }
    let stall = median(stalls);

    let gbs = |d: Duration| GIB / d.as_secs_f64() / 1e9;
    println!("tt-ckpt: durable 1 GiB save {:.2} s ({:.2} GB/s); dd conv=fsync {:.2} s ({:.2} GB/s); save_async stall {:.3} s/GiB",
        ours.as_secs_f64(), gbs(ours), dd.as_secs_f64(), gbs(dd), stall.as_secs_f64());
    println!(
        "row|durable save, 1 GiB f32 (GB/s)|{:.2}|dd bs=16M conv=fsync|{:.2}|GB/s|higher",
        gbs(ours),
        gbs(dd)
    );
    let py = std::env::var("TORCHTOOLS_PYTHON").ok().and_then(|py| {
        let out = Command::new(py)
            .args(["-W", "ignore", "-c", PYTHON])
            .arg(root.path().join("ckpt"))
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<f64>()
            .ok()
    });
    match py {
        Some(secs) => println!(
            "row|durable save, 1 GiB f32 (GB/s)|{:.2}|torch.save + fsync + rename|{:.2}|GB/s|higher",
            gbs(ours),
            GIB / secs / 1e9
        ),
        None => println!("  (no Python baseline: TORCHTOOLS_PYTHON with torch is needed; run `cargo xtask setup`)"),
    }
    println!(
        "row|save_async training stall per GiB (s)|{:.3}|goal|0.25|s|lower",
        stall.as_secs_f64()
    );
}
