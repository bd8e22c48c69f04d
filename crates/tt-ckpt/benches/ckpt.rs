//! `cargo bench -p tt-ckpt` (and `cargo xtask bench`): durable checkpoint writes
//! against `dd conv=fsync` (of zeros, and of the same random bytes) and Python's
//! `torch.save` + fsync + rename, into the same directory, in one run; verified loads
//! from a cold page cache against `cat` and the disk's direct reads at queue depth 8
//! (five runs, each of three loads taking turns with four direct reads, the median of
//! each side: the worst run, not only the median, beside direct reads judged the same
//! way in the loads' places, which shows how far the disk alone moves that ratio); and
//! the training stall of `save_async`, with its host buffers recycled and, in a
//! directory's first save, new (against libtorch's own copy into new memory).
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines for
//! the xtask table.

use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, CheckpointDir, LoadedCheckpoint};

/// Drops `path`'s pages from the page cache (they are clean: every file here was
/// fsynced), so that the next read comes from the disk.
fn evict(path: &Path) {
    let file = std::fs::File::open(path).expect("open to evict");
    // SAFETY: a plain system call on a descriptor open for its duration.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
}

const GIB: f64 = (1u64 << 30) as f64;
const RUNS: usize = 3;
/// Cold loads measured: the slowest of them is reported, not only the median.
const LOAD_RUNS: usize = 5;
/// Cold loads in each run, each between two direct reads.
const TURNS: usize = 3;

/// The disk's direct-read speed, as `fio --direct=1 --bs=8M --iodepth=8` measures it:
/// 8 threads reading the file's 8 MiB chunks with `O_DIRECT` (no page cache), each
/// chunk once. Seconds.
fn direct_reads(path: &Path) -> f64 {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const CHUNK: usize = 8 << 20;
    const DEPTH: usize = 8;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .expect("open O_DIRECT");
    let len = file.metadata().expect("stat").len() as usize;
    let chunks = len.div_ceil(CHUNK);
    let t = Instant::now();
    std::thread::scope(|s| {
        for k in 0..DEPTH {
            let file = &file;
            s.spawn(move || {
                // O_DIRECT wants a buffer aligned to the block size: page-aligned is.
                let layout = std::alloc::Layout::from_size_align(CHUNK, 4096).expect("layout");
                // SAFETY: a non-zero size with a valid alignment.
                let ptr = unsafe { std::alloc::alloc(layout) };
                assert!(!ptr.is_null(), "alloc");
                // SAFETY: ptr is valid for CHUNK bytes until the dealloc below.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr, CHUNK) };
                for c in (k..chunks).step_by(DEPTH) {
                    let _ = file.read_at(buf, (c * CHUNK) as u64).expect("direct read");
                }
                // SAFETY: allocated above with the same layout.
                unsafe { std::alloc::dealloc(ptr, layout) };
            });
        }
    });
    t.elapsed().as_secs_f64()
}

/// The middle value (of seconds or durations; a NaN sorts as equal).
use tt_testkit::bench::median;

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
    // Every tensor into `c` (the host copy a save starts with).
    let fill = |mut c: Checkpoint<'static>| {
        for (i, t) in tensors.iter().enumerate() {
            c.add_tch(&format!("t{i}"), t).expect("host copy");
        }
        c
    };
    let build = |step: u64| fill(Checkpoint::new(step));

    let dd_path = root.path().join("ckpt/dd.bin");
    // The same random bytes as the tensors, for dd to copy: a virtual disk may store
    // zeros for less than real data, so dd of /dev/zero alone flatters the disk.
    let random_src = root.path().join("random.bin");
    {
        let c = build(0);
        c.write_to(&random_src).expect("random source");
    }
    let run_dd = |input: &Path| {
        let t = Instant::now();
        let status = Command::new("dd")
            .arg(format!("if={}", input.display()))
            .args(["bs=16M", "count=64", "conv=fsync", "status=none"])
            .arg(format!("of={}", dd_path.display()))
            .status()
            .expect("dd");
        assert!(status.success());
        t.elapsed()
    };
    // Durable save: checksums, write, fsync, rename, directory fsync (host copy
    // excluded), alternating with dd after one warm-up of each: on a VM the first
    // touch of fresh memory (page cache included) costs several times a reuse.
    let (mut ours, mut dd, mut dd_random) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..=RUNS as u64 {
        let c = build(step);
        let t = Instant::now();
        dir.save(&c).expect("save");
        let ours_time = t.elapsed();
        let dd_time = run_dd(Path::new("/dev/zero"));
        let dd_random_time = run_dd(&random_src);
        if step > 0 {
            ours.push(ours_time);
            dd.push(dd_time);
            dd_random.push(dd_random_time);
        }
    }
    let (ours, dd, dd_random) = (median(ours), median(dd), median(dd_random));
    let _ = std::fs::remove_file(&dd_path);

    // Verified load from a cold page cache (map, read and check every byte) against
    // the disk's direct reads and `cat file > /dev/null`; and the load into tch
    // tensors, warm.
    let newest = dir.list().expect("list").pop().expect("a checkpoint").path;
    // A cold load's seconds; the pages it read leave the cache with it, so that every
    // direct read below starts from the same empty cache.
    let cold_load = || {
        evict(&newest);
        let t = Instant::now();
        let loaded = LoadedCheckpoint::read(&newest).expect("load");
        let secs = t.elapsed().as_secs_f64();
        drop(loaded);
        evict(&newest);
        secs
    };
    let (mut load, mut cat, mut into_tensors) = (Vec::new(), Vec::new(), Vec::new());
    let (mut direct, mut ratio, mut control) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..=LOAD_RUNS {
        // Loads and direct reads taking turns, D L D L D L D (an O_DIRECT read goes to
        // the disk whatever the page cache holds): this VM's disk changes speed from
        // one read to the next, by up to 1.5x, so a run compares the median of its
        // loads with the median of the direct reads around them.
        let mut loads = Vec::with_capacity(TURNS);
        let mut reads = vec![direct_reads(&newest)];
        for _ in 0..TURNS {
            loads.push(cold_load());
            reads.push(direct_reads(&newest));
        }
        // The control: the same sequence with direct reads in the loads' places, judged
        // the same way. How far below 1 it lands is how far the disk alone moves a run.
        let mut odd = Vec::with_capacity(TURNS);
        let mut even = vec![direct_reads(&newest)];
        for _ in 0..TURNS {
            odd.push(direct_reads(&newest));
            even.push(direct_reads(&newest));
        }
        let loaded = LoadedCheckpoint::read(&newest).expect("load");
        let t = Instant::now();
        for name in loaded.tensors().names() {
            drop(std::hint::black_box(
                loaded.tch(&name, Device::Cpu).expect("to tch"),
            ));
        }
        let tensors_time = t.elapsed();
        drop(loaded);
        evict(&newest);
        let t = Instant::now();
        let status = Command::new("cat")
            .arg(&newest)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("cat");
        assert!(status.success());
        let cat_time = t.elapsed();
        if run > 0 {
            let (l, d) = (median(loads), median(reads));
            load.push(Duration::from_secs_f64(l));
            direct.push(Duration::from_secs_f64(d));
            ratio.push(d / l);
            control.push(median(even) / median(odd));
            cat.push(cat_time);
            into_tensors.push(tensors_time);
        }
    }
    // The run furthest below the disk is reported, with that run's direct reads.
    let worst = (0..ratio.len())
        .min_by(|&a, &b| ratio[a].total_cmp(&ratio[b]))
        .expect("runs");
    let (worst_load, worst_direct, worst_ratio) = (load[worst], direct[worst], ratio[worst]);
    let gbs = |d: Duration| GIB / d.as_secs_f64() / 1e9;
    let runs: Vec<String> = load
        .iter()
        .zip(&direct)
        .map(|(&l, &d)| format!("{:.2}/{:.2}", gbs(l), gbs(d)))
        .collect();
    println!(
        "tt-ckpt: each run's cold loads / its direct reads, medians (GB/s): {}",
        runs.join(", ")
    );
    let ratios: Vec<String> = ratio.iter().map(|r| format!("{r:.2}")).collect();
    println!(
        "tt-ckpt: each run's loads against its direct reads: {}",
        ratios.join(", ")
    );
    let worst_control = control.iter().copied().fold(f64::INFINITY, f64::min);
    let controls: Vec<String> = control.iter().map(|c| format!("{c:.2}")).collect();
    println!(
        "tt-ckpt: the control, direct reads in the loads' places: {}",
        controls.join(", ")
    );
    let (load, cat, into_tensors) = (median(load), median(cat), median(into_tensors));

    // save_async: what the training loop waits for (host copy + hand-off) per GiB,
    // with the host buffers recycled by `dir.checkpoint` (after one warm-up save).
    let mut stalls = Vec::new();
    for step in 0..=RUNS as u64 {
        let t = Instant::now();
        let c = fill(dir.checkpoint(100 + step));
        dir.save_async(c).expect("save_async");
        let stall = t.elapsed();
        dir.wait().expect("the background save");
        if step > 0 {
            stalls.push(stall);
        }
    }
    let stall = median(stalls);

    // The first save_async of a directory, whose host buffers are new (their pages
    // first touched by the copy), against libtorch's own copy of the same tensors
    // into new memory (`torch.empty_like` + `copy_`: what staging a state dict on the
    // host costs PyTorch), taking turns.
    let (mut first, mut staged) = (Vec::new(), Vec::new());
    for run in 0..=RUNS {
        let path = root.path().join(format!("first-{run}"));
        let fresh = CheckpointDir::open(&path).expect("open");
        let t = Instant::now();
        let c = fill(fresh.checkpoint(1));
        fresh.save_async(c).expect("save_async");
        let ours_time = t.elapsed();
        fresh.wait().expect("the background save");
        drop(fresh);
        std::fs::remove_dir_all(&path).expect("remove the first save");
        let t = Instant::now();
        let copies: Vec<Tensor> = tensors
            .iter()
            .map(|x| {
                let mut copy = x.empty_like();
                copy.copy_(x);
                copy
            })
            .collect();
        let torch_time = t.elapsed();
        drop(copies);
        if run > 0 {
            first.push(ours_time);
            staged.push(torch_time);
        }
    }
    let (first, staged) = (median(first), median(staged));

    println!("tt-ckpt: durable 1 GiB save {:.2} s ({:.2} GB/s); dd conv=fsync of zeros {:.2} s ({:.2} GB/s), of the same random bytes {:.2} s ({:.2} GB/s); save_async stall {:.3} s/GiB",
        ours.as_secs_f64(), gbs(ours), dd.as_secs_f64(), gbs(dd), dd_random.as_secs_f64(), gbs(dd_random), stall.as_secs_f64());
    println!(
        "tt-ckpt: verified load, cold cache {:.2} s ({:.2} GB/s); cat {:.2} s ({:.2} GB/s); into tch tensors (warm) {:.2} s",
        load.as_secs_f64(),
        gbs(load),
        cat.as_secs_f64(),
        gbs(cat),
        into_tensors.as_secs_f64()
    );
    println!(
        "row|durable save, 1 GiB f32 (GB/s)|{:.2}|dd bs=16M conv=fsync of zeros|{:.2}|GB/s|higher",
        gbs(ours),
        gbs(dd)
    );
    println!(
        "row|durable save, 1 GiB f32 (GB/s)|{:.2}|dd conv=fsync of the same random bytes|{:.2}|GB/s|higher",
        gbs(ours),
        gbs(dd_random)
    );
    println!(
        "row|verified load, 1 GiB, cold cache (GB/s)|{:.2}|cat file > /dev/null, cold|{:.2}|GB/s|higher",
        gbs(load),
        gbs(cat)
    );
    println!(
        "row|verified load, 1 GiB, cold cache, the run of {LOAD_RUNS} furthest below the disk, median of its {TURNS} loads (GB/s)|{:.2}|O_DIRECT 8 MiB reads at queue depth 8 (fio's way) taking turns with them, median|{:.2}|GB/s|higher",
        gbs(worst_load),
        gbs(worst_direct)
    );
    println!(
        "row|cold loads against the direct reads taking turns with them, the lowest of {LOAD_RUNS} runs (x)|{worst_ratio:.2}|direct reads in the loads' places, judged the same way, the lowest of {LOAD_RUNS} (the disk against itself)|{worst_control:.2}|x|higher"
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
    println!(
        "row|save_async training stall per GiB, a directory's first save: new host buffers (s)|{:.3}|libtorch's empty_like + copy_ of the same tensors|{:.3}|s|lower",
        first.as_secs_f64(),
        staged.as_secs_f64()
    );
}
