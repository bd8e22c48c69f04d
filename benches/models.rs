//! `cargo bench -p torchtools --bench models` (and `cargo xtask bench`): the two real
//! models of `examples/models` trained on the CPU, where the GPU bundle's
//! `run.sh --bench models` trains them on a GPU.
//!
//! - A GPT-style decoder of 4.2M parameters (4 blocks of 256, 128 positions, causal
//!   scaled-dot-product attention) and ResNet-18's conv net with batch norm (11.2M
//!   parameters, 32x32 images): a float32 training step with AdamW through
//!   `Trainer::fit` against the same model in PyTorch eager (its own process, the same
//!   libtorch, the same threads), fresh random data each step, after five warm-up
//!   steps each; the median of five pairs of runs (see `median_pair`).
//! - The whole toolkit around the decoder's training (`Trainer::fit` with batches
//!   gathered on its loader thread, the resource tracker sampling every 100 ms, a
//!   checkpoint every 100 steps written in the background, metrics to JSON Lines)
//!   against a bare loop of the same batches and steps (the median of eleven pairs): on
//!   2 cores, every thread of the toolkit competes with the step's two compute threads.
//!   Then each part alone on top of `fit` and its loader (the tracker, the checkpoints,
//!   the metrics), five pairs each: where the cost goes.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.
//! `TORCHTOOLS_PYTHON` (default `python3`) is the PyTorch baseline's interpreter.

#[allow(dead_code)] // the GPU bench's parts of it
#[path = "../examples/models/mod.rs"]
mod models;

use std::cell::Cell;
use std::error::Error;
use std::time::Instant;

use torchtools::optim::{AdamConfig, Optimizer};
use torchtools::tch::nn;
use torchtools::tch::{Device, Kind, TchError, Tensor};
use torchtools::train::{Steps, TrainConfig, Trainer};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// The steps before the timed ones, on both sides (as `PY_MODELS` warms up).
const WARM_STEPS: u64 = 5;
/// Pairs of runs of ours and the baseline (see [`median_pair`]).
const ROUNDS: usize = 5;
/// The same for the toolkit's row, whose difference is a few percent.
const KIT_ROUNDS: usize = 11;

/// `rounds` pairs of runs, `ours` and `theirs` back to back (which goes first
/// alternating; tt-testkit's protocol): the median pair, with every pair's ratio said.
/// This VM's speed shifts by up to 20% for tens of seconds at a time (other tenants of
/// the host), which a pair of runs a few seconds long mostly sits within; medians of
/// each side's runs would compare runs from different phases.
fn median_pair(
    rounds: usize,
    ours: impl FnMut() -> Result<f64>,
    theirs: impl FnMut() -> Result<f64>,
) -> Result<(f64, f64)> {
    let pairs = tt_testkit::bench::paired(rounds, ours, theirs)?;
    let ratios: Vec<String> = pairs.ratios().iter().map(|r| format!("{r:.3}")).collect();
    println!(
        "  the pairs' ratios, sorted: {} ({pairs})",
        ratios.join(" ")
    );
    Ok(pairs.median())
}

fn adamw(vs: &nn::VarStore) -> Result<Optimizer> {
    Ok(Optimizer::adamw(
        vs,
        AdamConfig {
            lr: 1e-4,
            ..AdamConfig::adamw()
        },
    )?)
}

/// One model, built the same way every time.
enum Model {
    Gpt(models::Gpt),
    ResNet(models::ResNet),
}

impl Model {
    fn build(which: &str) -> Result<(nn::VarStore, Model, Optimizer)> {
        torchtools::tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = match which {
            "gpt" => Model::Gpt(models::Gpt::new(&vs.root(), &models::GptConfig::CPU)),
            _ => Model::ResNet(models::ResNet::new(&vs.root(), 10)),
        };
        let opt = adamw(&vs)?;
        Ok((vs, model, opt))
    }

    /// The loss on a fresh random batch of `b` samples (as `PY_MODELS` draws it).
    fn random_loss(&self, b: i64) -> std::result::Result<Tensor, TchError> {
        let cpu = Device::Cpu;
        Ok(match self {
            Model::Gpt(m) => {
                let c = models::GptConfig::CPU;
                m.loss(&Tensor::f_randint(
                    c.vocab,
                    [b, c.context + 1],
                    (Kind::Int64, cpu),
                )?)
            }
            Model::ResNet(m) => m.loss(
                &Tensor::f_randn([b, 3, 32, 32], (Kind::Float, cpu))?,
                &Tensor::f_randint(10, [b], (Kind::Int64, cpu))?,
            ),
        })
    }
}

/// One process's trainer on the CPU for `config`, without signal handlers, bar or
/// console lines (a benchmark's output is its rows).
fn quiet_trainer(config: TrainConfig) -> Result<Trainer> {
    let config = config.handle_signals(false).progress(false).console(false);
    let single = torchtools::dist::ProcessGroup::single();
    Ok(Trainer::with_group(config, single, Device::Cpu)?)
}

/// Seconds per step of `which` through `Trainer::fit`, after the warm-up.
fn ours(which: &str, batch: usize, steps: u64) -> Result<f64> {
    let (mut vs, model, mut opt) = Model::build(which)?;
    let total = WARM_STEPS + steps;
    let mut trainer = quiet_trainer(TrainConfig::new(batch as u64 * total, batch, 1))?;
    let start = Cell::new(None);
    trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            if ctx.step == WARM_STEPS {
                start.set(Some(Instant::now()));
            }
            model.random_loss(ctx.indices.len() as i64)
        }),
    )?;
    let start = start.get().ok_or("no step was timed")?;
    Ok(start.elapsed().as_secs_f64() / steps as f64)
}

/// The same in PyTorch eager, in its own process: seconds per step.
fn theirs(which: &str, batch: usize, steps: u64) -> Result<f64> {
    let (b, n) = (batch.to_string(), steps.to_string());
    let shape = models::GptConfig::CPU.py_shape();
    let text = models::python_baseline(
        which,
        &["-c", models::PY_MODELS, which, &b, &n],
        &[("TT_MODELS_DEVICE", "cpu"), ("TT_GPT_SHAPE", &shape)],
    )?;
    let secs = text
        .split_whitespace()
        .next()
        .ok_or("no time from PyTorch")?;
    Ok(secs.parse()?)
}

/// `(ours, theirs)` seconds per step: the median of [`ROUNDS`] pairs.
fn model_step(which: &str, batch: usize, steps: u64) -> Result<(f64, f64)> {
    median_pair(
        ROUNDS,
        || ours(which, batch, steps),
        || theirs(which, batch, steps),
    )
}

/// The models' rows: (model, name, batch, steps timed).
const MODELS: [(&str, &str, usize, u64); 2] = [
    ("gpt", "GPT-style decoder 4.2M (4x256), batch 8x128", 8, 10),
    ("resnet", "ResNet-18 (32x32), batch 8", 8, 6),
];

/// Steps of the toolkit's runs: two checkpoints each, at 100 and at the end.
const KIT_STEPS: u64 = 200;
const KIT_BATCH: usize = 1;

/// What runs around `fit`'s step (its loader thread always: the component rows add
/// one part each on top of it, the full row all of them).
#[derive(Debug, Clone, Copy)]
struct Kit {
    tracker: bool,
    checkpoints: bool,
    metrics: bool,
}

impl Kit {
    const FULL: Kit = Kit {
        tracker: true,
        checkpoints: true,
        metrics: true,
    };
    const LOADER: Kit = Kit {
        tracker: false,
        checkpoints: false,
        metrics: false,
    };
    /// One part each on top of the loader, for the component rows.
    const PARTS: [(&'static str, Kit); 4] = [
        ("fit with its loader alone", Kit::LOADER),
        (
            "fit + the tracker every 100 ms",
            Kit {
                tracker: true,
                ..Kit::LOADER
            },
        ),
        (
            "fit + a checkpoint every 100 steps",
            Kit {
                checkpoints: true,
                ..Kit::LOADER
            },
        ),
        (
            "fit + metrics to JSON Lines",
            Kit {
                metrics: true,
                ..Kit::LOADER
            },
        ),
    ];
}

/// The decoder's training through `fit` with `kit` around it, or (`None`) a bare loop
/// of the same batches: seconds per step.
fn toolkit(tokens: &Tensor, kit: Option<Kit>) -> Result<f64> {
    let samples = KIT_STEPS * KIT_BATCH as u64;
    let gather = |tokens: &Tensor, indices: &[u64]| -> std::result::Result<Tensor, TchError> {
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        tokens.f_index_select(0, &Tensor::from_slice(&idx))
    };
    let (mut vs, model, mut opt) = Model::build("gpt")?;
    let Model::Gpt(gpt) = model else {
        return Err("the decoder was asked for".into());
    };
    let Some(kit) = kit else {
        let sampler = torchtools::sampler::DistributedSampler::new(samples, 1, 0)?.with_seed(0);
        let mut batches = torchtools::train::EpochBatches::new(sampler, KIT_BATCH, 1)?;
        let (start, mut steps) = (Instant::now(), 0);
        while let Some(b) = batches.next_batch()? {
            let loss = gpt.loss(&gather(tokens, &b.indices)?);
            opt.backward_step(&loss)?;
            steps += 1;
        }
        return Ok(start.elapsed().as_secs_f64() / steps as f64);
    };
    let root = tempfile::tempdir()?;
    let mut config = TrainConfig::new(samples, KIT_BATCH, 1);
    if kit.checkpoints {
        config = config.checkpoints(root.path().join("ckpt"), 100);
    }
    if kit.metrics {
        config = config.metrics(root.path().join("metrics.jsonl"));
    }
    let mut trainer = quiet_trainer(config)?;
    let tracker = models::kit_tracker(kit.tracker)?;
    let loader_tokens = tokens.shallow_clone();
    let start = Instant::now();
    let work = Steps::prefetched(
        move |ctx| gather(&loader_tokens, ctx.indices),
        |_ctx, batch: Tensor| Ok::<_, TchError>(gpt.loss(&batch)),
    );
    let report = trainer.fit(&mut vs, &mut opt, work)?;
    let per_step = start.elapsed().as_secs_f64() / report.steps as f64;
    if let Some(tracker) = tracker {
        drop(tracker.stop()?);
    }
    Ok(per_step)
}

fn run() -> Result<()> {
    let threads = torchtools::tch::get_num_threads();
    let mut rows = Vec::new();
    // `-- toolkit` measures the toolkit's rows alone (the whole toolkit, then each part
    // of it on top of `fit`'s loader), `-- models` the models' rows alone.
    let only = std::env::args()
        .skip(1)
        .find(|a| a == "toolkit" || a == "models");
    let models = if only.as_deref() == Some("toolkit") {
        &[][..]
    } else {
        &MODELS[..]
    };
    for &(which, name, batch, steps) in models {
        let (a, b) = model_step(which, batch, steps)?;
        println!(
            "{name}: float32 step through fit {:.1} ms, PyTorch eager {:.1} ms ({threads} threads)",
            a * 1e3,
            b * 1e3
        );
        rows.push(format!(
            "row|{name}: CPU step, fit (ms)|{:.1}|PyTorch eager, same model|{:.1}|ms|lower",
            a * 1e3,
            b * 1e3
        ));
    }
    if only.as_deref() == Some("models") {
        rows.iter().for_each(|row| println!("{row}"));
        return Ok(());
    }
    let c = models::GptConfig::CPU;
    let samples = (KIT_STEPS * KIT_BATCH as u64) as i64;
    let tokens = Tensor::f_randint(
        c.vocab,
        [samples, c.context + 1],
        (Kind::Int64, Device::Cpu),
    )?;
    // A run of each to warm up, then pairs.
    toolkit(&tokens, Some(Kit::FULL))?;
    toolkit(&tokens, None)?;
    let (kit, bare) = median_pair(
        KIT_ROUNDS,
        || toolkit(&tokens, Some(Kit::FULL)),
        || toolkit(&tokens, None),
    )?;
    println!(
        "decoder, batch {KIT_BATCH}x128, {KIT_STEPS} steps: fit with tracker, loader, checkpoints, metrics {:.1} ms/step; bare loop {:.1} ms/step",
        kit * 1e3,
        bare * 1e3
    );
    rows.push(format!(
        "row|GPT 4.2M, batch 1x128: fit + tracker 100 ms + loader + checkpoint every 100 steps + metrics (ms/step)|{:.1}|a bare loop of the same steps|{:.1}|ms|lower",
        kit * 1e3,
        bare * 1e3
    ));
    // Where the cost goes: each part alone on top of the loader, against the bare loop.
    {
        for (what, part) in Kit::PARTS {
            let (ours, bare) = median_pair(
                ROUNDS,
                || toolkit(&tokens, Some(part)),
                || toolkit(&tokens, None),
            )?;
            rows.push(format!(
                "row|GPT 4.2M, batch 1x128: {what} (ms/step)|{:.1}|a bare loop of the same steps|{:.1}|ms|lower",
                ours * 1e3,
                bare * 1e3
            ));
        }
    }
    for row in rows {
        println!("{row}");
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("models bench: {e}");
        std::process::exit(1);
    }
}
