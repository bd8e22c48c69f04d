//! `cargo bench -p tt-adaptive` (and `cargo xtask bench`): the adaptive helpers against
//! a plain loop on the same work (the goal: ≤ 1.05× and ≤ 1 µs per call), and
//! the search policy's convergence next to halving's.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tch::{Device, Kind, TchError, Tensor};
use tt_adaptive::{Adaptive, Policy};

use tt_testkit::bench::median;

/// Median seconds per call of `f` over `n` calls, in `rounds` rounds.
fn per_call(rounds: usize, n: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..rounds)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..n {
                    f();
                }
                t.elapsed().as_secs_f64() / n as f64
            })
            .collect(),
    )
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() {
    let a = Adaptive::new();
    // toma's README workload: fill a 128x256x256 f32 tensor in chunks of 32 along dim 0.
    let out = Tensor::zeros([128, 256, 256], (Kind::Float, Device::Cpu));
    let native_fill = || {
        for start in (0..128).step_by(32) {
            let _ = out.narrow(0, start, 32).fill_(1.0);
        }
    };
    let ours_fill = || {
        a.chunked(&out, 0, 32, |chunk, _, _| -> Result<(), TchError> {
            chunk.f_fill_(1.0).map(drop)
        })
        .expect("fits");
    };
    // Alternate the two, so that neither gets the machine's quieter moments.
    let (mut n_times, mut o_times) = (Vec::new(), Vec::new());
    for _ in 0..9 {
        n_times.push(per_call(1, 50, native_fill));
        o_times.push(per_call(1, 50, ours_fill));
    }
    let (native, ours) = (median(n_times), median(o_times));
    // A 1 ms step, through batch and directly.
    let native_1ms = per_call(5, 200, || spin(Duration::from_millis(1)));
    let ours_1ms = per_call(5, 200, || {
        a.batch(64, |n| -> Result<usize, String> {
            spin(Duration::from_millis(1));
            Ok(n)
        })
        .expect("fits");
    });
    // The bare overhead: an empty closure.
    let step = |n: usize| -> Result<usize, String> { Ok(black_box(n)) };
    let direct = per_call(9, 200_000, || {
        black_box(step(black_box(64))).ok();
    });
    let wrapped = per_call(9, 200_000, || {
        black_box(a.batch(64, step)).ok();
    });
    let overhead_ns = (wrapped - direct) * 1e9;

    // Convergence: start 4096, capacity 1000, 20 calls.
    let budget = |n: usize| -> Result<usize, String> {
        if n > 1000 {
            Err("CUDA out of memory".into())
        } else {
            Ok(n)
        }
    };
    let converge = |p: Policy| {
        let a = Adaptive::new().policy(p);
        let mut last = 0;
        for _ in 0..20 {
            last = a.batch(4096, budget).expect("fits");
        }
        let s = &a.stats()[0];
        (last, s.attempts, s.ooms)
    };
    let (search_size, search_attempts, search_ooms) = converge(Policy::Search);
    let (halve_size, halve_attempts, halve_ooms) = converge(Policy::Halve);

    println!("tt-adaptive");
    println!(
        "  toma's chunked fill 128x256x256 / 32: native {:.3} ms, adaptive {:.3} ms ({:.3}x)",
        native * 1e3,
        ours * 1e3,
        ours / native
    );
    println!(
        "  1 ms step: native {:.4} ms, adaptive {:.4} ms ({:.4}x)",
        native_1ms * 1e3,
        ours_1ms * 1e3,
        ours_1ms / native_1ms
    );
    println!("  overhead of a successful call: {overhead_ns:.0} ns");
    println!("  convergence (start 4096, fits 1000, 20 calls): search -> {search_size} ({search_attempts} attempts, {search_ooms} OOMs); halving -> {halve_size} ({halve_attempts} attempts, {halve_ooms} OOMs)");
    println!(
        "row|toma workload: chunked fill 128x256x256 (ms/call)|{:.3}|plain loop|{:.3}|ms|lower",
        ours * 1e3,
        native * 1e3
    );
    println!(
        "row|1 ms step through batch (ms/call)|{:.4}|plain call|{:.4}|ms|lower",
        ours_1ms * 1e3,
        native_1ms * 1e3
    );
    println!("row|overhead of a successful batch call (ns)|{overhead_ns:.0}|goal|1000|ns|lower");
    println!("row|size after 20 calls, fits 1000 (search vs halving)|{search_size}|halving (toma)|{halve_size}|size|higher");
}
