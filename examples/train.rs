//! The unified trainer, one program for one process or many:
//!
//! ```sh
//! cargo run --example train                                  # one process
//! cargo build --example train
//! torchtools launch --nproc-per-node 2 -- target/debug/examples/train   # two ranks (Gloo on CPU)
//! torchrun --no-python --nproc-per-node 2 target/debug/examples/train   # the same, by torchrun
//! ```
//!
//! Batches are built on a loader thread while the step runs; each step is 2 accumulated
//! micro-batches, gradients are clipped to norm 1, and a held-out set is evaluated every
//! 20 steps (the best checkpoint is kept in `DIR/best`). A progress bar shows on a
//! terminal. `TORCHTOOLS_TRAIN_PRECISION=bf16` (or `fp16`, with loss scaling) runs the
//! forward pass in mixed precision; `TORCHTOOLS_TRAIN_LOGDIR=DIR` writes TensorBoard
//! event files (`tensorboard --logdir DIR`), `DIR/metrics.jsonl` and `DIR/loss.svg`.
//!
//! `TORCHTOOLS_TRAIN_CKPT=DIR` checkpoints there every 20 steps and resumes from it;
//! send SIGTERM (or Ctrl-C) mid-run and start it again: it continues exactly where it
//! stopped; a preempted run exits with status 75 (`torchtools::train::EXIT_PREEMPTED`),
//! which `torchtools launch` passes on without restarting. `TORCHTOOLS_TRAIN_EPOCHS`
//! (default 3) sets the epochs; `TORCHTOOLS_LOG=debug` shows more of what happens.
//! `TORCHTOOLS_TRAIN_STEPS_PER_RUN=N` trains at most N steps in one run and then waits
//! for SIGTERM, to watch a time limit (`torchtools reserve --time 10s --requeue`) or
//! `torchtools stop` cut the job and the next run resume it, whatever the machine's
//! speed; the result is the uninterrupted run's, bit for bit.

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;

use torchtools::optim::{Optimizer, SgdConfig};
use torchtools::tch::{nn, nn::Module, Kind, Reduction, TchError, Tensor};
use torchtools::train::{Eval, FitOutcome, Precision, StepContext, Steps, TrainConfig, Trainer};

const SAMPLES: u64 = 2048;
/// Micro-batches per step.
const ACCUMULATE: u64 = 2;
/// Held-out samples, after the training ones.
const HELD_OUT: std::ops::Range<u64> = SAMPLES..SAMPLES + 256;

fn main() -> ExitCode {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("train: {e}");
            ExitCode::FAILURE
        }
    }
}

fn epochs() -> Result<u64, String> {
    let Ok(v) = std::env::var("TORCHTOOLS_TRAIN_EPOCHS") else {
        return Ok(3);
    };
    let n = v.trim().parse::<u64>().ok().filter(|&n| n > 0);
    n.ok_or_else(|| format!("TORCHTOOLS_TRAIN_EPOCHS={v:?} is not a positive integer (e.g. 3)"))
}

/// `TORCHTOOLS_TRAIN_STEPS_PER_RUN`: the steps one run trains before it waits to be stopped.
fn steps_per_run() -> Result<Option<u64>, String> {
    let Ok(v) = std::env::var("TORCHTOOLS_TRAIN_STEPS_PER_RUN") else {
        return Ok(None);
    };
    let n = v.trim().parse::<u64>().ok().filter(|&n| n > 0);
    n.map(Some).ok_or_else(|| {
        format!("TORCHTOOLS_TRAIN_STEPS_PER_RUN={v:?} is not a positive integer (e.g. 20)")
    })
}

/// Sample i: a point t in [0, 1) spread by the golden ratio (so held-out indices are
/// drawn like the others), 16 features of t and a target (a stand-in for a dataset).
fn batch(ctx: &StepContext<'_>) -> Result<(Tensor, Tensor), TchError> {
    let t: Vec<f32> = ctx
        .indices
        .iter()
        .map(|&i| (i as f64 * 0.618_034).fract() as f32)
        .collect();
    let t = Tensor::from_slice(&t).f_to_device(ctx.device)?.unsqueeze(1);
    let freqs = Tensor::arange(16, (Kind::Float, ctx.device)).unsqueeze(0) + 1.0;
    Ok(((&t * &freqs * 3.0).sin(), (&t * 6.0).cos()))
}

fn run() -> Result<ExitCode, Box<dyn Error>> {
    // full, bf16 or fp16
    let precision =
        std::env::var("TORCHTOOLS_TRAIN_PRECISION").unwrap_or_else(|_| "full".to_owned());
    let per_run = steps_per_run()?;
    let mut config = TrainConfig::new(SAMPLES, 32, epochs()?)
        .seed(1)
        .accumulate(ACCUMULATE as usize)
        .clip_grad_norm(1.0)
        .precision(precision.parse::<Precision>()?)
        .log_every(20);
    if let Some(dir) = std::env::var_os("TORCHTOOLS_TRAIN_CKPT") {
        config = config.checkpoints(dir, 20);
    }
    if let Some(dir) = std::env::var_os("TORCHTOOLS_TRAIN_LOGDIR").map(PathBuf::from) {
        std::fs::create_dir_all(&dir)?;
        config = config
            .tensorboard(&dir)
            .metrics(dir.join("metrics.jsonl"))
            .loss_curve(dir.join("loss.svg"));
    }
    let mut trainer = Trainer::from_env(config)?;
    let main = trainer.is_main();
    if main {
        let group = trainer.group();
        let backend = group.backend().map(|b| format!("{b} backend"));
        let backend = backend.unwrap_or_else(|| "one process".to_owned());
        println!("{} on {:?}, {backend}", group.env(), trainer.device());
    }
    // Reproducible runs (rank 0's initialisation is broadcast to the others anyway).
    torchtools::tch::manual_seed(0);
    let mut vs = nn::VarStore::new(trainer.device());
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 1, Default::default()));
    let mut opt = Optimizer::sgd(
        &vs,
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    // The dtype the forward pass ran in (under autocast for bf16 and fp16), once.
    let forward_kind = std::sync::OnceLock::new();
    let loss = |(x, y): (Tensor, Tensor)| {
        let out = net.forward(&x);
        forward_kind.get_or_init(|| out.kind());
        out.to_kind(Kind::Float).f_mse_loss(&y, Reduction::Mean)
    };
    // Batches from `batch` on a loader thread; the same loss held out, without
    // gradients, every 20 steps, 64 samples a batch.
    let eval = Eval::lower_is_better(20, HELD_OUT, 64, |ctx| loss(batch(ctx)?));
    // With TORCHTOOLS_TRAIN_STEPS_PER_RUN, the first micro-batch after that many steps
    // waits for SIGTERM (the flag the trainer's own handler sets), then goes on: the
    // trainer finishes the step, checkpoints and exits preempted.
    let stop = torchtools::train::install_signal_handlers()?;
    let mut micro_batches = 0u64;
    let work = Steps::prefetched(batch, move |_, xy| {
        micro_batches += 1;
        if per_run.is_some_and(|n| micro_batches > n * ACCUMULATE) {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        loss(xy)
    })
    .eval(eval);
    let report = trainer.fit(&mut vs, &mut opt, work)?;
    if main {
        let kind = forward_kind.get().map_or("-".into(), |k| format!("{k:?}"));
        println!("precision {precision}: forward in {kind}");
        if let Some(scale) = report.loss_scale {
            let skipped = report.skipped_steps;
            println!("loss scale {scale}, {skipped} steps skipped (gradients not finite)");
        }
        if let Some((step, eval)) = report.best {
            println!("best held-out loss {eval:.5} at step {step}");
        }
        let steps = report.steps;
        let resumed = match report.resumed_from {
            Some(s) => format!(" (resumed from step {s})"),
            None => String::new(),
        };
        match report.outcome {
            FitOutcome::Finished => println!("finished: {steps} steps{resumed}"),
            FitOutcome::Preempted => {
                println!("preempted after step {steps}: checkpoint written; run it again to resume")
            }
        }
    }
    Ok(report.exit_code())
}
