//! Probe, then reserve, then train: the Python torchtools' `run_with_reservation_example`.
//! The training step's peak memory is measured in a fresh process (the binary re-runs
//! itself), the GPU is reserved for that much (lock + fence; on a machine without a GPU
//! there is nothing to reserve and it trains on the CPU), and the real training runs
//! on the reserved device; everything is released when it returns.
//!
//! ```sh
//! cargo run --example probe_reserve_train
//! ```

use std::error::Error;

use torchtools::probe::{BoxError, ProbeContext, ProbeOptions, Step};
use torchtools::tch::nn::{self, Module, OptimizerConfig};
use torchtools::tch::{Kind, Reduction, Tensor};
use torchtools::{run_training_with_reservation, RunOptions};

const BATCH: i64 = 256;

fn model(vs: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 64, 256, Default::default()))
        .add_fn(|t| t.relu())
        .add(nn::linear(vs / "l2", 256, 1, Default::default()))
}

/// The probe: one training step of the real model at the real batch size.
fn train_step(ctx: &ProbeContext) -> Result<Step, BoxError> {
    let vs = nn::VarStore::new(ctx.device);
    let net = model(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let device = ctx.device;
    Ok(Box::new(move || {
        let x = Tensor::f_randn([BATCH, 64], (Kind::Float, device))?;
        let loss = net.forward(&x).f_square()?.f_mean(Kind::Float)?;
        opt.backward_step(&loss);
        Ok(())
    }))
}

fn main() -> Result<(), Box<dyn Error>> {
    // In the probe's child process this runs the probe and exits; here it returns.
    torchtools::probe::entry(&[("train_step", train_step)]);
    // A bad TORCHTOOLS_LOG is an error before any work, as every other variable.
    if let Err(e) = torchtools::try_init_logging() {
        eprintln!("{}: {e}", env!("CARGO_CRATE_NAME"));
        std::process::exit(2);
    }
    torchtools::use_allowed_threads();
    let options = RunOptions {
        probe: Some(("train_step".into(), ProbeOptions::default())),
        ..RunOptions::default()
    };
    let (first, last) = run_training_with_reservation(
        |reservation, plan| -> Result<(f64, f64), BoxError> {
            println!("plan: {plan}");
            let device = reservation.device()?;
            torchtools::tch::manual_seed(0);
            let vs = nn::VarStore::new(device);
            let net = model(&vs.root());
            let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
            let x = Tensor::f_randn([BATCH, 64], (Kind::Float, device))?;
            let y = x.f_sum_dim_intlist(1, true, Kind::Float)?.f_sin()?;
            let mut losses = Vec::new();
            for _ in 0..100 {
                let loss = net.forward(&x).f_mse_loss(&y, Reduction::Mean)?;
                losses.push(loss.double_value(&[]));
                opt.backward_step(&loss);
            }
            Ok((losses[0], losses[losses.len() - 1]))
        },
        options,
    )?;
    println!("trained 100 steps: loss {first:.4} -> {last:.4}");
    if last.is_nan() || last >= first {
        return Err(format!("the loss did not go down ({first} -> {last})").into());
    }
    Ok(())
}
