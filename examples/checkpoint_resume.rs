//! A training loop of your own that survives `kill -9`: its parameters, optimizer
//! (moments, step count) and position in the data saved together every 10 steps, atomically,
//! and resumed together, so that an interrupted run ends exactly as an uninterrupted
//! one (cycling_utils' `AtomicDirectory` + `InterruptableDistributedSampler` +
//! `atomic_torch_save`, as one value: `TrainState`).
//!
//! ```sh
//! cargo run --example checkpoint_resume -- /tmp/ckpt   # kill it (Ctrl-C, kill -9) and run it again
//! cargo run --example checkpoint_resume -- /tmp/ckpt --wait-after 50   # waits after step 50: kill it there
//! ```
//! It prints `saved step N` after each checkpoint and, at the end, a checksum of the
//! parameters: the same whether or not it was interrupted.

use std::error::Error;

use torchtools::ckpt::CheckpointDir;
use torchtools::optim::{AdamConfig, Optimizer};
use torchtools::sampler::DistributedSampler;
use torchtools::tch::nn::{self, Module};
use torchtools::tch::{Device, Kind, Tensor};
use torchtools::train::{EpochBatches, TrainState};

const SAMPLES: u64 = 512;
const BATCH: usize = 16;
const EPOCHS: u64 = 3;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("checkpoint_resume: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: checkpoint_resume DIR [--wait-after STEP]";
    let dir = args.first().ok_or(usage)?;
    let wait_after: Option<u64> = match args.get(1).map(String::as_str) {
        None => None,
        Some("--wait-after") => Some(
            args.get(2)
                .and_then(|s| s.parse().ok())
                .ok_or("--wait-after needs a step number")?,
        ),
        Some(other) => return Err(format!("unknown argument {other:?}; {usage}").into()),
    };
    let dir = CheckpointDir::open(dir)?.keep_last(2);
    // Deterministic data and initial weights: the run depends on nothing else.
    torchtools::tch::manual_seed(0);
    let x = Tensor::randn([SAMPLES as i64, 8], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 8, 32, Default::default()))
        .add_fn(|t| t.tanh())
        .add(nn::linear(vs.root() / "l2", 32, 1, Default::default()));
    let optimizer = Optimizer::adam(
        &vs,
        AdamConfig {
            lr: 1e-2,
            ..AdamConfig::adam()
        },
    )?;
    let sampler = DistributedSampler::new(SAMPLES, 1, 0)?.with_seed(7);
    let batches = EpochBatches::new(sampler, BATCH, EPOCHS)?;
    let mut state = TrainState::new(vs, optimizer, batches);
    match state.resume(&dir)? {
        Some(step) => println!("resumed at step {step}"),
        None => println!("starting"),
    }
    while let Some(batch) = state.batches.next_batch()? {
        let idx: Vec<i64> = batch.indices.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx);
        let loss = net
            .forward(&x.index_select(0, &idx))
            .mse_loss(&y.index_select(0, &idx), torchtools::tch::Reduction::Mean);
        state.optimizer.backward_step(&loss)?;
        state.step += 1;
        if state.step % 10 == 0 {
            match state.save(&dir)? {
                Some(_) => println!("saved step {}", state.step),
                None => println!(
                    "step {}: not saved by this process (only rank 0 writes checkpoints)",
                    state.step
                ),
            }
        }
        if Some(state.step) == wait_after {
            println!("waiting after step {}: kill me now", state.step);
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
    }
    // A checksum of every parameter's bytes, in name order.
    let mut named = state.vs.variables().into_iter().collect::<Vec<_>>();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut sum = 0u64;
    for (_, t) in named {
        let values = Vec::<f32>::try_from(t.flatten(0, -1))?;
        for v in values {
            sum = sum.rotate_left(5) ^ u64::from(v.to_bits());
        }
    }
    println!(
        "finished {} steps; parameters checksum {sum:016x}",
        state.step
    );
    Ok(())
}
