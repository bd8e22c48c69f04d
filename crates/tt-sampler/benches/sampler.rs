//! `cargo bench -p tt-sampler` (and `cargo xtask bench`): the sampler's speed against
//! PyTorch's, side by side in one run, on the same machine.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.

use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use tt_sampler::{DistributedSampler, Reshard};

const LEN: u64 = 10_000_000;
const REPLICAS: u64 = 4;
const RUNS: usize = 5;

use tt_testkit::bench::median;

/// One whole epoch of rank 0: the permutation plus yielding every index.
fn epoch_time(epoch: u64) -> (Duration, u64) {
    let start = Instant::now();
    let mut s = DistributedSampler::new(LEN, REPLICAS, 0).expect("valid sampler");
    s.set_epoch(epoch);
    let mut n = 0u64;
    let mut sum = 0u64;
    for i in s.by_ref() {
        sum = sum.wrapping_add(i);
        n += 1;
    }
    black_box(sum);
    (start.elapsed(), n)
}

/// Loading a state at `progress` and getting the next index.
fn resume_time(progress: u64) -> Duration {
    let mut saved = DistributedSampler::new(LEN, REPLICAS, 0).expect("valid sampler");
    saved.set_epoch(1);
    saved.advance(progress).expect("within the epoch");
    let state = saved.state();
    let start = Instant::now();
    let mut s = DistributedSampler::new(LEN, REPLICAS, 0).expect("valid sampler");
    s.load_state(&state, Reshard::Refuse).expect("same shape");
    black_box(s.next_index().expect("no overflow"));
    start.elapsed()
}

const PYTHON: &str = r#"
import time, torch
from torch.utils.data import DistributedSampler
class Len:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
n, r = 10_000_000, 4
def best(f, k=3):
    ts = []
    for i in range(k):
        t = time.perf_counter(); f(i); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]
def sampler(i):
    s = DistributedSampler(Len(n), num_replicas=r, rank=0); s.set_epoch(i)
    for _ in s: pass
g = torch.Generator()
def randperm(i):
    g.manual_seed(i); torch.randperm(n, generator=g)
print(best(sampler), best(randperm))
"#;

fn python_baselines() -> Option<(f64, f64)> {
    let py = std::env::var("TORCHTOOLS_PYTHON").ok()?;
    let out = Command::new(py)
        .args(["-W", "ignore", "-c", PYTHON])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut it = text.split_whitespace().map(|v| v.parse::<f64>().ok());
    Some((it.next()??, it.next()??))
}

fn main() {
    let mut times = Vec::new();
    let mut per_rank = 0;
    for epoch in 0..RUNS as u64 {
        let (t, n) = epoch_time(epoch);
        times.push(t);
        per_rank = n;
    }
    let epoch = median(times);
    let ours_rate = per_rank as f64 / epoch.as_secs_f64() / 1e6;
    let at_start = median((0..RUNS).map(|_| resume_time(0)).collect());
    let at_end = median((0..RUNS).map(|_| resume_time(LEN / REPLICAS - 1)).collect());

    println!("tt-sampler, len {LEN}, {REPLICAS} replicas, rank 0 ({per_rank} indices per epoch)");
    println!(
        "  epoch incl. permutation: {:.1} ms -> {ours_rate:.1} M indices/s per rank",
        epoch.as_secs_f64() * 1e3
    );
    println!(
        "  resume at start: {:.1} ms, at end: {:.1} ms",
        at_start.as_secs_f64() * 1e3,
        at_end.as_secs_f64() * 1e3
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match python_baselines() {
        Some((sampler_s, randperm_s)) => {
            let py_rate = per_rank as f64 / sampler_s / 1e6;
            let randperm_rate = LEN as f64 / randperm_s / 1e6;
            println!("  python DistributedSampler: {py_rate:.1} M/s per rank; torch.randperm alone: {randperm_rate:.1} M/s");
            println!("row|sampler epoch, len 1e7, 4 ranks (M idx/s/rank)|{ours_rate:.1}|python DistributedSampler|{py_rate:.1}|M/s|higher");
            // Like for like: one epoch of a rank permutes all `LEN` positions (as
            // torch.randperm(LEN) does) and then yields its share; compare the
            // positions permuted per second, not the share's indices per second
            // with the whole permutation's (a factor of REPLICAS apart).
            let ours_perm_rate = LEN as f64 / epoch.as_secs_f64() / 1e6;
            println!("  one epoch permutes {LEN} positions: {ours_perm_rate:.1} M/s (torch.randperm: {randperm_rate:.1} M/s)");
            println!("row|sampler epoch (1e7 permutation + rank share) vs torch.randperm(1e7) alone (M positions/s)|{ours_perm_rate:.1}|torch.randperm(1e7)|{randperm_rate:.1}|M/s|higher");
        }
        None => println!("  (no Python baseline: TORCHTOOLS_PYTHON with torch is needed; run `cargo xtask setup`)"),
    }
    println!(
        "row|sampler resume at end of epoch (ms)|{:.1}|resume at start|{:.1}|ms|lower",
        ms(at_end),
        ms(at_start)
    );
}
