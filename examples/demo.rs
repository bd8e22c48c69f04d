//! The main job, run by `cargo xtask demo`: print the device report, then train a
//! tiny model for a few steps on the selected device, with a progress bar.
//!
//! `TORCHTOOLS_DEVICE` picks the device as everywhere in torchtools;
//! `TORCHTOOLS_DEMO_STEPS` (default 300) sets the number of steps.

use std::error::Error;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use torchtools::tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Reduction, Tensor};

fn steps_from_env() -> Result<u64, String> {
    match std::env::var("TORCHTOOLS_DEMO_STEPS") {
        Err(_) => Ok(300),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "TORCHTOOLS_DEMO_STEPS={v:?} is not a positive integer (e.g. 300)"
            )),
        },
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let steps = steps_from_env()?;
    // libtorch's intra-op threads: what this process may use (affinity, cgroup quota,
    // OMP_NUM_THREADS), not one per core of a machine shared with others.
    let budget = torchtools::use_allowed_threads();
    let report = torchtools::device::report();
    println!("{report}\n");
    println!("intra-op threads set to {budget}\n");
    let selection = match (&report.selected, &report.error) {
        (Some(s), _) => s.clone(),
        (None, e) => return Err(e.clone().unwrap_or_else(|| "no device".into()).into()),
    };
    let device: Device = selection.device.into();

    // Learn y = sin(3 x0) + x1^2 - x2 with a two-layer MLP.
    torchtools::tch::manual_seed(0);
    let x = Tensor::rand([4096, 3], (Kind::Float, device)) * 2.0 - 1.0;
    let y = ((x.select(1, 0) * 3.0).sin() + x.select(1, 1).square() - x.select(1, 2)).unsqueeze(1);
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 3, 64, Default::default()))
        .add_fn(|t| t.relu())
        .add(nn::linear(vs.root() / "l2", 64, 1, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;

    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("training on {msg} [{bar:30}] {pos}/{len} {per_sec}")?
            .progress_chars("=> "),
    );
    let eval_loss = || {
        torchtools::tch::no_grad(|| {
            net.forward(&x)
                .mse_loss(&y, Reduction::Mean)
                .double_value(&[])
        })
    };
    let first = eval_loss();
    let start = Instant::now();
    for _ in 0..steps {
        let loss = net.forward(&x).mse_loss(&y, Reduction::Mean);
        opt.backward_step(&loss);
        bar.set_message(format!(
            "{} (loss {:.4})",
            selection.device,
            loss.double_value(&[])
        ));
        bar.inc(1);
    }
    bar.finish();
    let last = eval_loss();
    println!(
        "trained {steps} steps on {} in {:.2?}: loss {first:.4} -> {last:.4}",
        selection.device,
        start.elapsed()
    );
    if last.is_nan() || last >= first {
        return Err(format!("the loss did not go down ({first} -> {last})").into());
    }
    Ok(())
}
