//! `cargo bench -p tt-train` (and `cargo xtask bench`): the trainer's own cost on the
//! CPU. The same steps (an MLP 64-256-10, batches of 64 from data in memory, SGD) through
//! `Trainer::fit` and in a hand-written loop over the same batches, alternating five
//! rounds of 1,200 steps; medians. A small step makes the trainer's per-step work (the
//! boxed step function, the loss kept as a tensor, the stop flag, the loggers) visible.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines, which
//! `cargo xtask bench` gathers into its table, after a human-readable summary.

use std::time::Instant;

use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};
use tt_optim::{Optimizer, SgdConfig};
use tt_sampler::DistributedSampler;
use tt_train::{EpochBatches, Steps, TrainConfig, Trainer};

const SAMPLES: i64 = 64 * 1200;
const BATCH: usize = 64;

use tt_testkit::bench::median;

/// The model and its optimizer, the same initialisation every time.
fn build() -> (nn::VarStore, impl Module, Optimizer) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 64, 256, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 256, 10, Default::default()));
    let opt = Optimizer::sgd(&vs, SgdConfig::default()).expect("SGD's defaults are valid");
    (vs, net, opt)
}

fn main() {
    tch::set_num_threads(1);
    let x = Tensor::randn([SAMPLES, 64], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([SAMPLES, 10], (Kind::Float, Device::Cpu));
    let batch = |indices: &[u64]| {
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx);
        (x.index_select(0, &idx), y.index_select(0, &idx))
    };
    let (mut t_fit, mut t_hand) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let config = TrainConfig::new(SAMPLES as u64, BATCH, 1)
            .seed(1)
            .handle_signals(false)
            .console(false);
        let mut trainer = Trainer::with_group(config, tt_dist::ProcessGroup::single(), Device::Cpu)
            .expect("a valid configuration");
        let (mut vs, net, mut opt) = build();
        let start = Instant::now();
        let work = Steps::new(|ctx| {
            let (bx, by) = batch(ctx.indices);
            net.forward(&bx).f_mse_loss(&by, Reduction::Mean)
        });
        let report = trainer.fit(&mut vs, &mut opt, work).expect("trains");
        t_fit.push(start.elapsed().as_secs_f64() / report.steps as f64);

        let (_vs, net, mut opt) = build();
        let sampler = DistributedSampler::new(SAMPLES as u64, 1, 0)
            .expect("a valid sampler")
            .with_seed(1);
        let mut batches = EpochBatches::new(sampler, BATCH, 1).expect("valid batches");
        let (start, mut steps) = (Instant::now(), 0);
        while let Some(b) = batches.next_batch().expect("a batch") {
            let (bx, by) = batch(&b.indices);
            opt.zero_grad();
            let loss = net.forward(&bx).mse_loss(&by, Reduction::Mean);
            opt.backward_step(&loss).expect("a step");
            steps += 1;
        }
        t_hand.push(start.elapsed().as_secs_f64() / steps as f64);
    }
    let (fit, hand) = (median(t_fit), median(t_hand));
    println!("tt-train");
    println!(
        "  a step of an MLP 64-256-10, batch 64, one CPU thread: fit {:.1} us, by hand {:.1} us ({:.3}x)",
        fit * 1e6,
        hand * 1e6,
        fit / hand
    );
    println!(
        "row|trainer: a small CPU step through fit (us/step)|{:.1}|hand-written loop|{:.1}|us|lower",
        fit * 1e6,
        hand * 1e6
    );
}
