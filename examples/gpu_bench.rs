//! GPU benchmarks (`run.sh --bench` of the bundle that `cargo xtask test-gpu --bundle DIR`
//! builds): what torchtools costs on a real GPU, beside a baseline where there is one.
//!
//! - the memory fence: raising and lowering it, per GiB;
//! - tt-adaptive on real CUDA out-of-memory errors: a batch size search starting at
//!   twice the free memory, its attempts and its final size against the largest that fits;
//! - the resource tracker sampling every 10 ms beside a GPU-bound loop: the loop's
//!   slowdown;
//! - one training step of the same MLP in tch and in PyTorch eager on the same GPU (the
//!   kernels are the same: the ratio is the cost of the Rust side);
//! - the unified trainer's own cost: a step through `Trainer::fit` against the same step
//!   in a hand-written loop;
//! - two real models (a GPT-style decoder of about 85M parameters and a ResNet-18-style
//!   conv net with batch norm), a bf16 training step with AdamW through `Trainer::fit`
//!   against the same model in PyTorch eager (its step time and its peak of allocated
//!   GPU memory), 5 alternating pairs;
//! - the largest batch of each model that fits beside a fence leaving 16 GiB: predicted
//!   by tt-probe from three probes, against a binary search by real runs;
//! - a checkpoint of the GPT's CUDA state (parameters and AdamW's moments) taken while
//!   it trains: the training loop's stall and the time until the file is durable,
//!   `save_async` against PyTorch's `torch.distributed.checkpoint.async_save` and an
//!   fsynced `torch.save` of the same state;
//! - the whole toolkit around the GPT's training (`Trainer::fit` with prefetched batches,
//!   tracker sampling every 100 ms, batches gathered on the loader thread, a checkpoint
//!   every 100 steps, metrics to JSON Lines) against a bare loop of the same steps, per
//!   step while training and for the whole run with its final durable checkpoint
//!   (`toolkit`), and each part alone with a timeline of every run (`toolkit-parts`).
//!
//! ```sh
//! cargo run --example gpu_bench            # on a machine with a GPU and PyTorch 2.11
//! ```
//!
//! `TORCHTOOLS_PYTHON` (default `python3`) is the PyTorch baseline's interpreter.

#[allow(dead_code)] // the CPU bench's parts of it (benches/models.rs)
#[path = "models/mod.rs"]
mod models;

use std::error::Error;
use std::time::{Duration, Instant};

use torchtools::adaptive::{Adaptive, CudaMemory, Policy};
use torchtools::device::Bytes;
use torchtools::fence::{Fence, FenceOptions};
use torchtools::tch::nn::{self, Module, OptimizerConfig};
use torchtools::tch::{Device, Kind, Reduction, TchError, Tensor};
use torchtools::tracker::{Tracker, TrackerConfig};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn main() {
    // The probe children of the `maxbatch` rows are this program, re-executed.
    torchtools::probe::entry(&[("gpt", gpt_probe), ("resnet", resnet_probe)]);
    torchtools::init_logging();
    if let Err(e) = run() {
        eprintln!("gpu_bench: {e}");
        std::process::exit(1);
    }
}

use tt_testkit::bench::median;

/// Pairs of runs for each ratio of the models' and the toolkit's rows (ours and the
/// baseline back to back, the order alternating): the median pair is the row, the
/// spread of all pairs is beside it.
const PAIRS: usize = 5;

struct Row {
    what: String,
    ours: String,
    baseline: String,
    ratio: String,
}

fn row(what: impl Into<String>, ours: impl Into<String>) -> Row {
    Row {
        what: what.into(),
        ours: ours.into(),
        baseline: "-".into(),
        ratio: "-".into(),
    }
}

fn run() -> Result<()> {
    let info = torchtools::sys::ensure_cuda_loaded()?;
    if info.device_count == 0 {
        return Err("no CUDA device: the GPU benchmarks need one".into());
    }
    // `gpu_bench [GROUP..]`: only those groups of rows; none: all of them.
    type Group = fn() -> Result<Vec<Row>>;
    let groups: [(&str, Group); 11] = [
        ("fence", fence_rows),
        ("adaptive", adaptive_rows),
        ("tracker", || Ok(vec![tracker_row()?])),
        ("training", || Ok(vec![training_row()?])),
        ("trainer", || Ok(vec![trainer_row()?])),
        ("models", model_rows),
        ("optimizer", optimizer_rows),
        ("maxbatch", max_batch_rows),
        ("checkpoint", checkpoint_rows),
        ("toolkit", || toolkit_rows(false)),
        ("toolkit-parts", || toolkit_rows(true)),
    ];
    let asked: Vec<String> = std::env::args().skip(1).collect();
    if let Some(bad) = asked.iter().find(|a| !groups.iter().any(|(g, _)| g == a)) {
        let names: Vec<&str> = groups.iter().map(|(g, _)| *g).collect();
        return Err(format!("no group of rows {bad:?}: use any of {}", names.join(", ")).into());
    }
    let name = torchtools::device::Inventory::query()
        .gpus
        .first()
        .map_or_else(|| "a GPU".to_owned(), |g| g.name.clone());
    let mut rows = Vec::new();
    for (group_name, group) in groups {
        if asked.is_empty() || asked.iter().any(|a| a == group_name) {
            let these = group()?;
            // Each group's rows as soon as they are measured (a run stopped at a time
            // limit keeps them), then the whole table at the end.
            for r in &these {
                println!("row: {}", format_row(r));
            }
            rows.extend(these);
        }
    }
    println!("\ntorchtools GPU benchmarks on {name}");
    println!(
        "{:<52} {:>14} {:>14} {:>8}",
        "what", "torchtools", "baseline", "ratio"
    );
    for r in rows {
        println!("{}", format_row(&r));
    }
    Ok(())
}

fn format_row(r: &Row) -> String {
    format!(
        "{:<52} {:>14} {:>14} {:>8}",
        r.what, r.ours, r.baseline, r.ratio
    )
}

/// Raise a fence leaving 4 GiB free, lower it; 5 times, medians per GiB.
fn fence_rows() -> Result<Vec<Row>> {
    let (mut raise, mut lower, mut gib) = (Vec::new(), Vec::new(), 0.0);
    for _ in 0..5 {
        let start = Instant::now();
        let mut fence = Fence::raise(0, &FenceOptions::keep_free(Bytes::gib(4)))?;
        let raised = start.elapsed().as_secs_f64();
        gib = fence.fenced().0 as f64 / GIB as f64;
        let start = Instant::now();
        fence.lower()?;
        let lowered = start.elapsed().as_secs_f64();
        raise.push(raised * 1e3 / gib);
        lower.push(lowered * 1e3 / gib);
    }
    Ok(vec![
        row(
            format!("fence raise, per GiB ({gib:.1} GiB fenced)"),
            format!("{:.3} ms", median(raise)),
        ),
        row("fence lower, per GiB", format!("{:.3} ms", median(lower))),
    ])
}

/// `mib` MiB of zeros on the GPU, or the CUDA out-of-memory error.
fn alloc_mib(mib: usize) -> std::result::Result<(), TchError> {
    let t = Tensor::f_zeros([mib as i64, MIB as i64], (Kind::Uint8, Device::Cuda(0)))?;
    drop(t);
    Ok(())
}

/// The largest allocation that fits now, by bisection to 16 MiB (the cache emptied
/// before and after each try).
fn largest_that_fits(below_mib: usize) -> Result<usize> {
    let (mut ok, mut bad) = (0usize, below_mib);
    while bad - ok > 16 {
        torchtools::sys::empty_cache()?;
        let mid = ok + (bad - ok) / 2;
        if alloc_mib(mid).is_ok() {
            ok = mid;
        } else {
            bad = mid;
        }
    }
    torchtools::sys::empty_cache()?;
    Ok(ok)
}

/// tt-adaptive on real CUDA OOMs: 10 calls of one call site, each asking for twice the
/// free memory, with toma's halving and with the search; the first and the tenth call's
/// size against the largest that fits, and the OOMs all calls met.
fn adaptive_rows() -> Result<Vec<Row>> {
    torchtools::sys::empty_cache()?;
    let free_mib = (torchtools::sys::mem_get_info(0)?.free / MIB) as usize;
    let largest = largest_that_fits(2 * free_mib)?;
    let mut rows = Vec::new();
    for (label, policy) in [
        ("halve (toma's)", Policy::Halve),
        ("search", Policy::Search),
    ] {
        let adaptive = Adaptive::new().policy(policy).memory(CudaMemory(0));
        let mut sizes = Vec::new();
        let start = Instant::now();
        for _ in 0..10 {
            let got = adaptive
                .batch(2 * free_mib, |n| alloc_mib(n).map(|()| n))
                .map_err(|e| format!("the adaptive search found no size: {e}"))?;
            sizes.push(got);
        }
        let took = start.elapsed();
        torchtools::sys::empty_cache()?;
        let ooms: u64 = adaptive.stats().iter().map(|s| s.ooms).sum();
        rows.push(Row {
            what: format!("adaptive {label}: calls 1 and 10, MiB ({ooms} OOMs)"),
            ours: format!("{} / {}", sizes[0], sizes[9]),
            baseline: format!("{largest} fits"),
            ratio: format!(
                "{:.2}/{:.2}",
                sizes[0] as f64 / largest as f64,
                sizes[9] as f64 / largest as f64
            ),
        });
        rows.push(row(
            format!("adaptive {label}: 10 calls"),
            format!("{:.0} ms", took.as_secs_f64() * 1e3),
        ));
    }
    Ok(rows)
}

/// Seconds per 4096² matmul, the median of 5 runs of `n`, synchronised.
fn matmul_seconds(n: usize) -> f64 {
    let a = Tensor::randn([4096, 4096], (Kind::Float, Device::Cuda(0)));
    let mut times = Vec::new();
    for _ in 0..5 {
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        let mut b = a.shallow_clone();
        for _ in 0..n {
            b = b.matmul(&a).clamp(-1.0, 1.0);
        }
        torchtools::tch::Cuda::synchronize(0);
        times.push(start.elapsed().as_secs_f64() / n as f64);
    }
    median(times)
}

/// A GPU-bound loop with and without the tracker sampling every 10 ms.
fn tracker_row() -> Result<Row> {
    matmul_seconds(50); // warm-up
    let without = matmul_seconds(400);
    let tracker = Tracker::start(TrackerConfig {
        interval: Duration::from_millis(10),
        ..TrackerConfig::default()
    })?;
    let with = matmul_seconds(400);
    let _usage = tracker.stop()?;
    Ok(Row {
        what: "tracker every 10 ms: 4096² matmul step".into(),
        ours: format!("{:.3} ms", with * 1e3),
        baseline: format!("{:.3} ms", without * 1e3),
        ratio: format!("{:.3}", without / with),
    })
}

const STEPS: usize = 300;
const PY_STEP: &str = r#"
import sys, time, torch
torch.manual_seed(0)
dev = "cuda:0"
model = torch.nn.Sequential(
    torch.nn.Linear(784, 4096), torch.nn.ReLU(),
    torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
    torch.nn.Linear(4096, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(256, 784, device=dev); y = torch.randn(256, 10, device=dev)
def step():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
steps = int(sys.argv[1])
for _ in range(30): step()
times = []
for _ in range(5):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(steps): step()
    torch.cuda.synchronize(); times.append((time.perf_counter() - t) / steps)
print(sorted(times)[2])
"#;

/// The MLP 784-4096-4096-10 of the training benchmarks, under `vs`.
fn mlp(vs: &nn::VarStore) -> nn::Sequential {
    let p = vs.root();
    nn::seq()
        .add(nn::linear(&p / "l1", 784, 4096, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l2", 4096, 4096, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l3", 4096, 10, Default::default()))
}

/// One training step of the MLP 784-4096-4096-10 (batch 256, SGD with momentum): tch
/// against PyTorch eager, each the median of 5 runs of 300 steps.
fn training_row() -> Result<Row> {
    let dev = Device::Cuda(0);
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(dev);
    let model = mlp(&vs);
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.01)?;
    let x = Tensor::randn([256, 784], (Kind::Float, dev));
    let y = Tensor::randn([256, 10], (Kind::Float, dev));
    let mut step = || {
        opt.zero_grad();
        let loss = model.forward(&x).mse_loss(&y, Reduction::Mean);
        loss.backward();
        opt.step();
    };
    for _ in 0..30 {
        step();
    }
    let mut times = Vec::new();
    for _ in 0..5 {
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        for _ in 0..STEPS {
            step();
        }
        torchtools::tch::Cuda::synchronize(0);
        times.push(start.elapsed().as_secs_f64() / STEPS as f64);
    }
    let ours = median(times);
    let theirs: f64 = models::python_baseline("MLP", &["-c", PY_STEP, &STEPS.to_string()], &[])?
        .trim()
        .parse()?;
    Ok(Row {
        what: "training step, MLP 784-4096-4096-10, batch 256".into(),
        ours: format!("{:.3} ms", ours * 1e3),
        baseline: format!("{:.3} ms", theirs * 1e3),
        ratio: format!("{:.3}", theirs / ours),
    })
}

const SAMPLES: i64 = 256 * 100;

/// The MLP 784-4096-4096-10 on the GPU, with tt-optim's SGD (momentum 0.9).
fn mlp_on_gpu() -> Result<(nn::VarStore, nn::Sequential, torchtools::optim::Optimizer)> {
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let model = mlp(&vs);
    let opt = torchtools::optim::Optimizer::sgd(
        &vs,
        torchtools::optim::SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    Ok((vs, model, opt))
}

/// Seconds per step of 3 epochs of 100 steps (batch 256, data on the GPU): through
/// `Trainer::fit` (one process), and in a hand-written loop over the same batches.
fn trainer_row() -> Result<Row> {
    use torchtools::train::{Steps, TrainConfig, Trainer};
    let dev = Device::Cuda(0);
    let x = Tensor::randn([SAMPLES, 784], (Kind::Float, dev));
    let y = Tensor::randn([SAMPLES, 10], (Kind::Float, dev));
    let batch = |indices: &[u64]| {
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx).to_device(dev);
        (x.index_select(0, &idx), y.index_select(0, &idx))
    };
    let (mut t_fit, mut t_loop) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        // Through the trainer.
        let mut config = TrainConfig::new(SAMPLES as u64, 256, 3).seed(1);
        config = config.handle_signals(false);
        config = config.log_every(100);
        let mut trainer =
            Trainer::with_group(config, torchtools::dist::ProcessGroup::single(), dev)?;
        let (mut vs, model, mut opt) = mlp_on_gpu()?;
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        let report = trainer.fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                let (bx, by) = batch(ctx.indices);
                Ok::<_, TchError>(model.forward(&bx).mse_loss(&by, Reduction::Mean))
            }),
        )?;
        torchtools::tch::Cuda::synchronize(0);
        t_fit.push(start.elapsed().as_secs_f64() / report.steps as f64);

        // By hand: the same sampler order, batches, model and optimizer.
        let (_vs, model, mut opt) = mlp_on_gpu()?;
        let sampler =
            torchtools::sampler::DistributedSampler::new(SAMPLES as u64, 1, 0)?.with_seed(1);
        let mut batches = torchtools::train::EpochBatches::new(sampler, 256, 3)?;
        let mut steps = 0;
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        while let Some(b) = batches.next_batch()? {
            let (bx, by) = batch(&b.indices);
            opt.zero_grad();
            opt.backward_step(&model.forward(&bx).mse_loss(&by, Reduction::Mean))?;
            steps += 1;
        }
        torchtools::tch::Cuda::synchronize(0);
        t_loop.push(start.elapsed().as_secs_f64() / steps as f64);
    }
    let (fit, hand) = (median(t_fit), median(t_loop));
    Ok(Row {
        what: "trainer: step through fit vs a hand-written loop".into(),
        ours: format!("{:.3} ms", fit * 1e3),
        baseline: format!("{:.3} ms", hand * 1e3),
        ratio: format!("{:.3}", hand / fit),
    })
}

/// AdamW as the PyTorch baselines configure it (`lr=1e-4`, torch's defaults otherwise).
fn adamw_as_the_baseline(
    vs: &nn::VarStore,
) -> std::result::Result<torchtools::optim::Optimizer, torchtools::optim::Error> {
    use torchtools::optim::{AdamConfig, Optimizer};
    Optimizer::adamw(
        vs,
        AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adamw()
        },
    )
}

/// The steps timed after a warm-up of [`WARM_STEPS`].
const WARM_STEPS: u64 = 5;

/// One model's bf16 training through `Trainer::fit` (AdamW, lr 1e-4, fresh random data
/// on the GPU each step): seconds per step after the warm-up, and the peak of allocated
/// GPU memory over those steps.
fn ours(which: &str, batch: usize, steps: u64) -> Result<(f64, u64)> {
    use std::cell::Cell;
    use torchtools::train::{Precision, Steps, TrainConfig, Trainer};
    let dev = Device::Cuda(0);
    torchtools::sys::empty_cache()?;
    torchtools::tch::manual_seed(0);
    let mut vs = nn::VarStore::new(dev);
    let gpt = (which == "gpt").then(|| models::Gpt::new(&vs.root(), &models::GptConfig::GPU));
    let resnet = (which != "gpt").then(|| models::ResNet::new(&vs.root(), 10));
    let mut opt = adamw_as_the_baseline(&vs)?;
    let total = WARM_STEPS + steps;
    let mut config = TrainConfig::new(batch as u64 * total, batch, 1).precision(Precision::Bf16);
    config = config.handle_signals(false);
    config = config.progress(false);
    config = config.log_every(total);
    let mut trainer = Trainer::with_group(config, torchtools::dist::ProcessGroup::single(), dev)?;
    let start = Cell::new(None);
    trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            if ctx.step == WARM_STEPS {
                torchtools::tch::Cuda::synchronize(0);
                let _ = torchtools::sys::reset_peak_stats(0);
                start.set(Some(Instant::now()));
            }
            let b = ctx.indices.len() as i64;
            Ok::<_, TchError>(match (&gpt, &resnet) {
                (Some(m), _) => m.loss(&Tensor::f_randint(2048, [b, 513], (Kind::Int64, dev))?),
                (_, Some(m)) => m.loss(
                    &Tensor::f_randn([b, 3, 32, 32], (Kind::Float, dev))?,
                    &Tensor::f_randint(10, [b], (Kind::Int64, dev))?,
                ),
                _ => unreachable!("one model is built"),
            })
        }),
    )?;
    torchtools::tch::Cuda::synchronize(0);
    let secs = start
        .get()
        .ok_or("no step was timed")?
        .elapsed()
        .as_secs_f64()
        / steps as f64;
    let peak = torchtools::sys::device_stats(0)?.allocated_bytes.peak;
    Ok((secs, peak))
}

/// The same in PyTorch eager, in its own process.
fn theirs(which: &str, batch: usize, steps: u64) -> Result<(f64, u64)> {
    let (b, n) = (batch.to_string(), steps.to_string());
    let text = models::python_baseline(which, &["-c", models::PY_MODELS, which, &b, &n], &[])?;
    let mut words = text.split_whitespace();
    let secs: f64 = words.next().ok_or("no time from PyTorch")?.parse()?;
    let peak: u64 = words.next().ok_or("no peak from PyTorch")?.parse()?;
    Ok((secs, peak))
}

/// Per model: the step time and the peak memory, ours against PyTorch eager: pairs of
/// runs in alternating order (tt-testkit's protocol), the median pair's ratio with the
/// spread of all [`PAIRS`].
fn model_rows() -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (which, name, batch, steps) in [
        ("gpt", "GPT 85M (12x768), batch 16x512", 16, 30),
        ("resnet", "ResNet-18 (32x32), batch 256", 256, 50),
    ] {
        let (mut m_ours, mut m_theirs) = (Vec::new(), Vec::new());
        let times = tt_testkit::bench::paired(
            PAIRS,
            || -> Result<f64> {
                let (t, m) = ours(which, batch, steps)?;
                m_ours.push(m as f64);
                Ok(t)
            },
            || -> Result<f64> {
                let (t, m) = theirs(which, batch, steps)?;
                m_theirs.push(m as f64);
                Ok(t)
            },
        )?;
        let (a, b) = times.median();
        rows.push(Row {
            what: format!("{name}: bf16 step, fit vs PyTorch eager"),
            ours: format!("{:.2} ms", a * 1e3),
            baseline: format!("{:.2} ms", b * 1e3),
            ratio: times.to_string(),
        });
        let (a, b) = (median(m_ours), median(m_theirs));
        rows.push(Row {
            what: format!("{name}: peak GPU memory allocated"),
            ours: format!("{:.2} GiB", a / GIB as f64),
            baseline: format!("{:.2} GiB", b / GIB as f64),
            ratio: format!("{:.3}", b / a),
        });
    }
    Ok(rows)
}

/// The GPT's optimizer alone (its 148 parameter tensors, gradients from one backward):
/// tt-optim's AdamW step and `zero_grad` against torch.optim.AdamW's step with its
/// default multi-tensor (`foreach`) kernels and with one tensor at a time
/// (`foreach=False`), and `zero_grad()` of existing gradients (both set them to None).
/// Medians of 5 runs (of 20 steps).
fn optimizer_rows() -> Result<Vec<Row>> {
    use torchtools::optim::{AdamConfig, Optimizer};
    let dev = Device::Cuda(0);
    torchtools::sys::empty_cache()?;
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(dev);
    let gpt = models::Gpt::new(&vs.root(), &models::GptConfig::GPU);
    let mut opt = Optimizer::adamw(&vs, AdamConfig::adamw())?;
    gpt.loss(&Tensor::randint(2048, [4, 513], (Kind::Int64, dev)))
        .backward();
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut v = Vec::new();
        for _ in 0..5 {
            torchtools::tch::Cuda::synchronize(0);
            let start = Instant::now();
            for _ in 0..20 {
                f()?;
            }
            torchtools::tch::Cuda::synchronize(0);
            v.push(start.elapsed().as_secs_f64() / 20.0);
        }
        Ok(median(v))
    };
    let step = time(&mut || Ok(opt.step()?))?;
    // Clearing gradients that exist (each run after one backward).
    let mut clears = Vec::new();
    for _ in 0..5 {
        gpt.loss(&Tensor::randint(2048, [4, 513], (Kind::Int64, dev)))
            .backward();
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        opt.zero_grad();
        torchtools::tch::Cuda::synchronize(0);
        clears.push(start.elapsed().as_secs_f64());
    }
    let zero = median(clears);
    let script = format!("{}\n{PY_OPT_STEP}", models::PY_MODELS);
    let text = models::python_baseline("optimizer", &["-c", &script, "gpt", "4", "1"], &[])?;
    let figures: Vec<f64> = text
        .lines()
        .last()
        .unwrap_or("")
        .split_whitespace()
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    let [foreach, single, zero_theirs] = figures[..] else {
        return Err(format!("the PyTorch optimizer baseline printed {text:?}").into());
    };
    let ms = |s: f64| format!("{:.2} ms", s * 1e3);
    Ok(vec![
        Row {
            what: "GPT's AdamW step alone vs torch's (foreach)".into(),
            ours: ms(step),
            baseline: ms(foreach),
            ratio: format!("{:.3}", foreach / step),
        },
        Row {
            what: "GPT's AdamW step alone vs torch's (foreach=False)".into(),
            ours: ms(step),
            baseline: ms(single),
            ratio: format!("{:.3}", single / step),
        },
        Row {
            what: "GPT's zero_grad (to None) vs torch's zero_grad()".into(),
            ours: ms(zero),
            baseline: ms(zero_theirs),
            ratio: format!("{:.3}", zero_theirs / zero),
        },
    ])
}

/// Appended to [`models::PY_MODELS`] (run for one step): the optimizer's step alone,
/// foreach and one tensor at a time, and `zero_grad()` of existing gradients.
const PY_OPT_STEP: &str = r#"
model.loss(*data()).backward()
def timed(f):
    v = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): f()
        torch.cuda.synchronize(); v.append((time.perf_counter() - t) / 20)
    return sorted(v)[2]
grads = [p.grad.clone() for p in model.parameters()]
def restore():
    for p, g in zip(model.parameters(), grads): p.grad = g.clone()
out = []
for foreach in (True, False):
    o = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    restore(); o.step()
    out.append(timed(o.step))
restore()
def zero():
    restore(); torch.cuda.synchronize(); t = time.perf_counter()
    o.zero_grad(); torch.cuda.synchronize()
    return time.perf_counter() - t
out.append(sorted(zero() for _ in range(5))[2])
print(*out)
"#;

/// A probe step of one model: its bf16 training step (AdamW) at the batch asked for.
fn model_probe(
    ctx: &torchtools::probe::ProbeContext,
    which: &str,
) -> std::result::Result<torchtools::probe::Step, torchtools::probe::BoxError> {
    let dev = ctx.device;
    let b = i64::try_from(ctx.batch.unwrap_or(2))?;
    let vs = nn::VarStore::new(dev);
    let gpt = (which == "gpt").then(|| models::Gpt::new(&vs.root(), &models::GptConfig::GPU));
    let resnet = (which != "gpt").then(|| models::ResNet::new(&vs.root(), 10));
    let mut opt = adamw_as_the_baseline(&vs)?;
    Ok(Box::new(move || {
        let _keep = &vs;
        let loss = torchtools::sys::autocast(dev, Kind::BFloat16, || {
            Ok::<_, TchError>(match (&gpt, &resnet) {
                (Some(m), _) => m.loss(&Tensor::f_randint(2048, [b, 513], (Kind::Int64, dev))?),
                (_, Some(m)) => m.loss(
                    &Tensor::f_randn([b, 3, 32, 32], (Kind::Float, dev))?,
                    &Tensor::f_randint(10, [b], (Kind::Int64, dev))?,
                ),
                _ => unreachable!("one model is built"),
            })
        })??;
        opt.backward_step(&loss)?;
        Ok(())
    }))
}

fn gpt_probe(
    ctx: &torchtools::probe::ProbeContext,
) -> std::result::Result<torchtools::probe::Step, torchtools::probe::BoxError> {
    model_probe(ctx, "gpt")
}

fn resnet_probe(
    ctx: &torchtools::probe::ProbeContext,
) -> std::result::Result<torchtools::probe::Step, torchtools::probe::BoxError> {
    model_probe(ctx, "resnet")
}

/// Per model, beside a fence that leaves 16 GiB free: the largest batch tt-probe
/// predicts from at most three probes, against the largest a binary search by real
/// training steps (three each, in a fresh process) finds, to 0.5%.
fn max_batch_rows() -> Result<Vec<Row>> {
    use torchtools::probe::{max_batch, probe, BatchSearch, ProbeError, ProbeOptions};
    let _fence = Fence::raise(0, &FenceOptions::keep_free(Bytes::gib(16)))?;
    let capacity = torchtools::device::Inventory::query()
        .gpus
        .first()
        .map(|g| g.free)
        .ok_or("NVML reports no GPU")?;
    let mut rows = Vec::new();
    // The first probe's batch: where two probes' memory differs by more than the
    // allocator's rounding (a ResNet-18 sample of 32x32 is about a megabyte).
    for (which, name, first) in [
        ("gpt", "GPT 85M, context 512", 2),
        ("resnet", "ResNet-18 32x32", 64),
    ] {
        let run = |batch: u64| {
            probe(
                which,
                &ProbeOptions {
                    batch: Some(batch),
                    steps: 3,
                    timeout: Duration::from_secs(300),
                    ..ProbeOptions::default()
                },
            )
        };
        let start = Instant::now();
        let search = BatchSearch {
            start: first,
            ..BatchSearch::new(capacity)
        };
        let found = max_batch(&search, run)?;
        let predicted_in = start.elapsed().as_secs_f64();
        eprintln!("gpu_bench: {which}: {found}");
        // Real runs: a batch fits when three steps run without running out of memory.
        let fits = |batch: u64| -> Result<bool> {
            match run(batch) {
                Ok(_) => Ok(true),
                Err(ProbeError::OutOfMemory { .. }) => Ok(false),
                Err(e) => Err(e.into()),
            }
        };
        let start = Instant::now();
        let mut runs = 0;
        let (mut lo, mut hi) = (
            found.probes.last().map_or(1, |(b, _)| *b),
            found.batch * 11 / 10,
        );
        loop {
            runs += 1;
            if !fits(hi)? {
                break;
            }
            lo = hi;
            hi *= 2;
        }
        while hi - lo > (lo / 200).max(1) {
            let mid = lo + (hi - lo) / 2;
            runs += 1;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let searched_in = start.elapsed().as_secs_f64();
        eprintln!("gpu_bench: {which}: largest batch by {runs} real runs: {lo}");
        rows.push(Row {
            what: format!("{name}: largest batch in {capacity}, predicted vs searched"),
            ours: format!("{}", found.batch),
            baseline: format!("{lo}"),
            ratio: format!("{:.3}", found.batch as f64 / lo as f64),
        });
        rows.push(Row {
            what: format!("{name}: runs to find it (seconds)"),
            ours: format!("{} ({predicted_in:.0} s)", found.probes.len()),
            baseline: format!("{runs} ({searched_in:.0} s)"),
            ratio: format!("{:.3}", searched_in / predicted_in),
        });
    }
    Ok(rows)
}

/// Seconds to load the checkpoint at `path` onto `dev` (medians of three, alternating):
/// verified and through pinned buffers, and each tensor through pageable host memory
/// (a tch tensor of the bytes, then `to_device`).
fn load_times(path: &std::path::Path, dev: Device) -> Result<(f64, f64)> {
    let load = |pinned: bool| -> Result<f64> {
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        let loaded = torchtools::ckpt::LoadedCheckpoint::read(path)?;
        let tensors = match pinned {
            true => loaded.tch_all(dev)?,
            false => {
                let file = loaded.tensors();
                let mut all = Vec::new();
                for name in file.names() {
                    let view = file.tensor(&name)?;
                    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                    let kind = torchtools::ckpt::kind_of(view.dtype())?;
                    let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
                    all.push((name, t.f_to_device(dev)?));
                }
                all
            }
        };
        torchtools::tch::Cuda::synchronize(0);
        let took = start.elapsed().as_secs_f64();
        drop(tensors);
        Ok(took)
    };
    let (mut pinned, mut pageable) = (Vec::new(), Vec::new());
    load(true)?;
    for round in 0..3 {
        if round % 2 == 0 {
            pinned.push(load(true)?);
            pageable.push(load(false)?);
        } else {
            pageable.push(load(false)?);
            pinned.push(load(true)?);
        }
    }
    Ok((median(pinned), median(pageable)))
}

/// PyTorch's side of the checkpoint rows, in `theirs_dir`: the state's bytes, DCP
/// `async_save`'s stall and time until durable, `torch.save` + fsync's stall, and
/// `torch.load`'s time onto the GPU (seconds).
fn pytorch_checkpoint(theirs_dir: &std::path::Path) -> Result<[f64; 5]> {
    std::fs::create_dir_all(theirs_dir)?;
    let text = models::python_baseline(
        "checkpoint",
        &[
            "-c",
            models::PY_MODELS,
            "gpt-ckpt",
            "16",
            "0",
            &theirs_dir.to_string_lossy(),
        ],
        &[],
    )?;
    let v: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    <[f64; 5]>::try_from(v).map_err(|_| format!("the checkpoint baseline printed {text:?}").into())
}

/// The GPT (batch 16x512) and its AdamW state on the GPU, checkpointed while it trains:
/// the cost to the training loop (the save call and the next step, against a step
/// alone) and the time until the file is durable, per GiB of state; `save_async`
/// against PyTorch's `async_save` (DCP) and an fsynced `torch.save` in its own
/// process; then the last file loaded back onto the GPU, against `torch.load` of
/// PyTorch's file and against a load through pageable memory. Medians of three.
fn checkpoint_rows() -> Result<Vec<Row>> {
    use torchtools::ckpt::CheckpointDir;
    use torchtools::optim::Optimizer;
    let dev = Device::Cuda(0);
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(dev);
    let gpt = models::Gpt::new(&vs.root(), &models::GptConfig::GPU);
    let mut opt = adamw_as_the_baseline(&vs)?;
    let step = |opt: &mut Optimizer| -> Result<()> {
        let tokens = Tensor::f_randint(2048, [16, 513], (Kind::Int64, dev))?;
        let loss = torchtools::sys::autocast(dev, Kind::BFloat16, || gpt.loss(&tokens))?;
        opt.backward_step(&loss)?;
        Ok(())
    };
    // Seconds of `f` (a call, then one training step) to the GPU's end of it.
    let timed = |f: &mut dyn FnMut() -> Result<()>| {
        torchtools::tch::Cuda::synchronize(0);
        let start = Instant::now();
        f()?;
        torchtools::tch::Cuda::synchronize(0);
        Ok::<_, Box<dyn Error>>(start.elapsed().as_secs_f64())
    };
    for _ in 0..5 {
        step(&mut opt)?;
    }
    let mut plain = Vec::new();
    for _ in 0..5 {
        plain.push(timed(&mut || step(&mut opt))?);
    }
    let plain = median(plain);
    let root = tempfile::tempdir()?;
    let dir = CheckpointDir::open(root.path().join("ours"))?
        .writer(true)
        .keep_last(2);
    let (mut stall, mut durable, mut bytes) = (Vec::new(), Vec::new(), 0u64);
    let mut last = None;
    for i in 0..3 {
        let start = Instant::now();
        let took = timed(&mut || {
            let mut ckpt = dir.checkpoint(i + 1);
            ckpt.add_var_store(&vs)?;
            opt.save_into(&mut ckpt, "optim")?;
            dir.save_async(ckpt)?;
            step(&mut opt)
        })?;
        let path = dir.wait()?.ok_or("no checkpoint written")?;
        durable.push(start.elapsed().as_secs_f64());
        stall.push((took - plain).max(0.0));
        bytes = std::fs::metadata(&path)?.len();
        last = Some(path);
    }
    let gib = bytes as f64 / GIB as f64;
    // The last checkpoint loaded onto the GPU (warm in the page cache, as the Python
    // side's file).
    let path = last.ok_or("no checkpoint written")?;
    let (pinned, pageable) = load_times(&path, dev)?;
    let [state, a_stall, a_durable, s_stall, t_load] =
        pytorch_checkpoint(&root.path().join("theirs"))?;
    let their_gib = state / GIB as f64;
    let (ours_stall, ours_durable) = (median(stall) / gib, median(durable) / gib);
    let per = |s: f64| format!("{:.1} ms/GiB", s * 1e3);
    Ok(vec![
        Row {
            what: format!("GPT + AdamW state ({gib:.2} GiB): stall, save_async vs DCP async_save"),
            ours: per(ours_stall),
            baseline: per(a_stall / their_gib),
            ratio: format!("{:.1}", (a_stall / their_gib) / ours_stall.max(1e-6)),
        },
        Row {
            what: "  the same, vs torch.save + fsync".into(),
            ours: per(ours_stall),
            baseline: per(s_stall / their_gib),
            ratio: format!("{:.1}", (s_stall / their_gib) / ours_stall.max(1e-6)),
        },
        Row {
            what: "  time until durable, save_async vs DCP async_save".into(),
            ours: per(ours_durable),
            baseline: per(a_durable / their_gib),
            ratio: format!("{:.2}", (a_durable / their_gib) / ours_durable),
        },
        Row {
            what: "  load onto cuda:0 (verified, pinned) vs torch.load(map_location=cuda)".into(),
            ours: per(pinned / gib),
            baseline: per(t_load / their_gib),
            ratio: format!("{:.2}", (t_load / their_gib) / (pinned / gib)),
        },
        Row {
            what: "  the same, vs each tensor through pageable memory (tch's to_device)".into(),
            ours: per(pinned / gib),
            baseline: per(pageable / gib),
            ratio: format!("{:.2}", pageable / pinned),
        },
    ])
}

/// When each step of a `fit` ended (its `on_step`), as the host saw it: a step's kernels
/// are queued ahead of the GPU by at most about one step (CUDA's launch queue fills
/// first), so the gaps between these instants are the steps' times on the GPU to within
/// a step. The last step waits for the GPU, as the bare loop's end does.
struct StepClock {
    times: std::sync::Arc<std::sync::Mutex<Vec<Instant>>>,
    last: u64,
}

impl torchtools::train::Logger for StepClock {
    fn on_step(&mut self, step: u64) {
        if step == self.last {
            torchtools::tch::Cuda::synchronize(0);
        }
        if let Ok(mut times) = self.times.lock() {
            times.push(Instant::now());
        }
    }

    fn on_log(
        &mut self,
        _: &torchtools::train::LogRecord,
    ) -> std::result::Result<(), torchtools::train::BoxError> {
        Ok(())
    }
}

/// One toolkit run's clock: seconds per step while training (the start to the last
/// step's end), the seconds `fit` took after its last step (the final checkpoint made
/// durable, the loggers closed), and each step's gap.
struct KitRun {
    per_step: f64,
    end: f64,
    gaps: Vec<f64>,
}

impl KitRun {
    /// One line of the timeline: where the steps' time went.
    fn timeline(&self, what: &str) -> String {
        let ms = |s: f64| s * 1e3;
        let mut sorted = self.gaps.clone();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q) as usize];
        let med = at(0.5);
        // The time above the median step: after the checkpoints (steps 101, 201: the
        // first step after each start of one) and elsewhere.
        let excess = |steps: &mut dyn Iterator<Item = usize>| -> f64 {
            steps
                .filter_map(|i| self.gaps.get(i))
                .map(|g| (g - med).max(0.0))
                .sum()
        };
        let after_ckpt = excess(&mut [100, 101, 200, 201].into_iter());
        let all = excess(&mut (1..self.gaps.len()));
        format!(
            "{what}: {:.2} ms/step; gaps median {:.2}, p90 {:.2}, p99 {:.2}, max {:.2} ms; \
             above the median: {:.1} ms in all, {:.1} ms at steps 101-102/201-202; \
             end of fit {:.1} ms",
            ms(self.per_step),
            ms(med),
            ms(at(0.9)),
            ms(at(0.99)),
            ms(sorted[sorted.len() - 1]),
            ms(all),
            ms(after_ckpt),
            ms(self.end)
        )
    }
}

/// The toolkit rows' steps, their batch and dataset (the GPT's tokens in host memory).
const KIT_STEPS: u64 = 300;
const KIT_BATCH: usize = 16;

/// What runs around the step: (tracker, checkpoints, metrics), `fit`'s loader always.
type Kit = (bool, bool, bool);

/// The GPT, its AdamW and its VarStore on the GPU, from seed 0.
fn kit_model() -> Result<(nn::VarStore, models::Gpt, torchtools::optim::Optimizer)> {
    torchtools::tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let gpt = models::Gpt::new(&vs.root(), &models::GptConfig::GPU);
    let opt = adamw_as_the_baseline(&vs)?;
    Ok((vs, gpt, opt))
}

/// The batch of `indices` gathered from `tokens` on the host, on the GPU.
fn gather(tokens: &Tensor, indices: &[u64]) -> std::result::Result<Tensor, TchError> {
    let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
    tokens
        .f_index_select(0, &Tensor::from_slice(&idx))?
        .f_to_device(Device::Cuda(0))
}

/// One run through `fit` with `kit` around it, clocked step by step.
fn kit_run(tokens: &Tensor, (tracked, checkpoints, metrics): Kit) -> Result<KitRun> {
    use torchtools::train::{Precision, Steps, TrainConfig, Trainer};
    let dev = Device::Cuda(0);
    let samples = KIT_STEPS * KIT_BATCH as u64;
    let root = tempfile::tempdir()?;
    let (mut vs, gpt, mut opt) = kit_model()?;
    let mut config = TrainConfig::new(samples, KIT_BATCH, 1).precision(Precision::Bf16);
    if checkpoints {
        config = config.checkpoints(root.path().join("ckpt"), 100);
    }
    if metrics {
        config = config.metrics(root.path().join("metrics.jsonl"));
    }
    config = config.handle_signals(false);
    config = config.progress(false);
    let mut trainer = Trainer::with_group(config, torchtools::dist::ProcessGroup::single(), dev)?;
    let times = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    trainer.add_logger(StepClock {
        times: times.clone(),
        last: KIT_STEPS,
    });
    let tracker = models::kit_tracker(tracked)?;
    let loader_tokens = tokens.shallow_clone();
    torchtools::tch::Cuda::synchronize(0);
    let start = Instant::now();
    let work = Steps::prefetched(
        move |ctx| gather(&loader_tokens, ctx.indices),
        |_ctx, batch: Tensor| Ok::<_, TchError>(gpt.loss(&batch)),
    );
    let report = trainer.fit(&mut vs, &mut opt, work)?;
    torchtools::tch::Cuda::synchronize(0);
    let end = Instant::now();
    if let Some(tracker) = tracker {
        drop(tracker.stop()?);
    }
    let times = times.lock().map_err(|_| "the step clock's lock")?.clone();
    let last = *times.last().ok_or("no step ended")?;
    if report.steps != KIT_STEPS || times.len() as u64 != KIT_STEPS {
        let (ran, clocked) = (report.steps, times.len());
        return Err(format!("{ran} steps ran, {clocked} clocked, not {KIT_STEPS}").into());
    }
    let mut gaps = vec![(times[0] - start).as_secs_f64()];
    gaps.extend(times.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()));
    Ok(KitRun {
        per_step: (last - start).as_secs_f64() / KIT_STEPS as f64,
        end: (end - last).as_secs_f64(),
        gaps,
    })
}

/// The same steps in a bare loop: seconds per step.
fn bare_run(tokens: &Tensor) -> Result<f64> {
    let (_vs, gpt, mut opt) = kit_model()?;
    let samples = KIT_STEPS * KIT_BATCH as u64;
    let sampler = torchtools::sampler::DistributedSampler::new(samples, 1, 0)?.with_seed(0);
    let mut batches = torchtools::train::EpochBatches::new(sampler, KIT_BATCH, 1)?;
    let mut steps = 0;
    torchtools::tch::Cuda::synchronize(0);
    let start = Instant::now();
    while let Some(b) = batches.next_batch()? {
        let batch = gather(tokens, &b.indices)?;
        let loss = torchtools::sys::autocast(Device::Cuda(0), Kind::BFloat16, || gpt.loss(&batch))?;
        opt.backward_step(&loss)?;
        steps += 1;
    }
    torchtools::tch::Cuda::synchronize(0);
    Ok(start.elapsed().as_secs_f64() / steps as f64)
}

/// The GPT (batch 16x512, bf16, AdamW) for 300 steps from a token dataset in host
/// memory: through `Trainer::fit` with prefetched batches and the whole toolkit on (the
/// tracker every 100 ms, the loader thread, a checkpoint every 100 steps written in the
/// background, metrics to JSON Lines) against a bare loop that gathers the same batches
/// and steps the same model; then each part alone on top of `fit` and its loader (where
/// the cost goes). Each round runs the bare loop and every variant, in an order that
/// reverses from round to round; each variant's ratio is the median of its [`PAIRS`]
/// pairs with the round's bare loop, the spread beside it. Per step while training:
/// from the start to the end of the last step; what `fit` does after it (the final
/// checkpoint made durable, once per run whatever its length) is a row of its own, and
/// the whole run's ratio with it. A warm-up run of each first (CUDA's caching
/// allocator, cuBLAS and the checkpoints' pinned buffers warm for both). The batch (66
/// KB) goes to the GPU from pageable memory: `pin_memory` through tch warns on every
/// call that its device argument is deprecated.
fn toolkit_rows(parts: bool) -> Result<Vec<Row>> {
    let samples = KIT_STEPS as i64 * KIT_BATCH as i64;
    let tokens = Tensor::randint(2048, [samples, 513], (Kind::Int64, Device::Cpu));
    let variants: [(&str, Kit); 5] = [
        ("all", (true, true, true)),
        ("loader", (false, false, false)),
        ("tracker", (true, false, false)),
        ("checkpoints", (false, true, false)),
        ("metrics", (false, false, true)),
    ];
    let variants = &variants[..if parts { variants.len() } else { 1 }];
    kit_run(&tokens, (true, true, true))?;
    bare_run(&tokens)?;
    // Per variant: its runs, and the bare loop of the same round beside each.
    let mut runs: Vec<Vec<(KitRun, f64)>> = variants.iter().map(|_| Vec::new()).collect();
    for round in 0..PAIRS {
        let mut order: Vec<Option<usize>> = std::iter::once(None)
            .chain((0..variants.len()).map(Some))
            .collect();
        if round % 2 == 1 {
            order.reverse();
        }
        let mut bare = f64::NAN;
        let mut these = Vec::new();
        for which in order {
            match which {
                None => bare = bare_run(&tokens)?,
                Some(v) => these.push((v, kit_run(&tokens, variants[v].1)?)),
            }
        }
        for (v, run) in these {
            let what = format!(
                "toolkit round {round} {:<11} (bare {:.2} ms/step)",
                variants[v].0,
                bare * 1e3
            );
            println!("{}", run.timeline(&what));
            runs[v].push((run, bare));
        }
    }
    Ok(toolkit_table(&runs))
}

/// The toolkit's rows from each variant's runs beside their rounds' bare loops.
fn toolkit_table(runs: &[Vec<(KitRun, f64)>]) -> Vec<Row> {
    let ms = |s: f64| format!("{:.2} ms", s * 1e3);
    let pairs_of = |v: usize, whole: bool| {
        tt_testkit::bench::Pairs::from_pairs(
            runs[v]
                .iter()
                .map(|(r, bare)| {
                    let ours = match whole {
                        true => r.per_step + r.end / KIT_STEPS as f64,
                        false => r.per_step,
                    };
                    (ours, *bare)
                })
                .collect(),
        )
    };
    let mut rows = Vec::new();
    let mut push = |what: &str, pairs: tt_testkit::bench::Pairs| {
        let (ours, bare) = pairs.median();
        rows.push(Row {
            what: what.into(),
            ours: ms(ours),
            baseline: ms(bare),
            ratio: pairs.to_string(),
        });
    };
    push(
        "GPT: fit + tracker, loader, checkpoints, metrics vs a bare loop, per step",
        pairs_of(0, false),
    );
    push(
        "  the whole 300-step run, the final checkpoint durable",
        pairs_of(0, true),
    );
    let parts_rows = [
        (1, "  fit with its loader alone"),
        (2, "  fit + the tracker every 100 ms"),
        (3, "  fit + a checkpoint every 100 steps"),
        (4, "  fit + metrics to JSON Lines"),
    ];
    for (v, what) in parts_rows.into_iter().filter(|(v, _)| *v < runs.len()) {
        push(what, pairs_of(v, false));
    }
    let ends: Vec<f64> = runs[0].iter().map(|(r, _)| r.end).collect();
    rows.push(Row {
        what: "  after the last step: the final checkpoint (0.99 GiB) durable".into(),
        ours: ms(median(ends)),
        baseline: "-".into(),
        ratio: "-".into(),
    });
    rows
}
