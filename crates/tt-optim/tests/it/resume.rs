//! save → kill -9 → resume ends with exactly the parameters of an uninterrupted run.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, CheckpointDir};
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule, SgdConfig};

const HALF: i64 = 20;

fn algorithms() -> Vec<(&'static str, Algorithm, Schedule)> {
    vec![
        (
            "adamw",
            Algorithm::AdamW(AdamConfig {
                lr: 0.02,
                amsgrad: true,
                ..AdamConfig::adamw()
            }),
            Schedule::WarmupCosine {
                warmup: 5,
                start_factor: 0.2,
                t_max: 30,
                eta_min: 1e-4,
            },
        ),
        (
            "sgd",
            Algorithm::Sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 1e-3,
                ..Default::default()
            }),
            Schedule::Step {
                step_size: 10,
                gamma: 0.5,
            },
        ),
    ]
}

fn model(vs: &nn::VarStore) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(vs.root() / "l1", 3, 16, Default::default()))
        .add_fn(|t| t.tanh())
        .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()))
}

/// Step `k`'s batch: deterministic, different every step.
fn batch(k: i64) -> (Tensor, Tensor) {
    let x =
        ((Tensor::arange(48, (Kind::Float, Device::Cpu)) * 0.37 + k as f64).sin()).reshape([16, 3]);
    let y = x.sum_dim_intlist(1, true, Kind::Float).cos();
    (x, y)
}

fn train(net: &nn::Sequential, opt: &mut Optimizer, steps: std::ops::Range<i64>) {
    for k in steps {
        let (x, y) = batch(k);
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            .unwrap();
    }
}

/// A model whose weights depend on `seed` only: not on libtorch's global generator,
/// which tests running in parallel threads would reseed under each other's feet.
fn fresh(
    seed: i64,
    alg: Algorithm,
    schedule: Schedule,
) -> (nn::VarStore, nn::Sequential, Optimizer) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = model(&vs);
    tch::no_grad(|| {
        for (_, mut var) in vs.variables() {
            let n = var.numel() as i64;
            let values =
                (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.61 + seed as f64).sin() * 0.4;
            var.copy_(&values.reshape(var.size()));
        }
    });
    let opt = Optimizer::new(&vs, alg, schedule).unwrap();
    (vs, net, opt)
}

/// The child: train the first half, checkpoint, say so, then wait to be killed.
#[test]
#[ignore = "a child process's entry point, run by the resume tests"]
fn resume_child() {
    let (Ok(dir), Ok(which)) = (std::env::var("TT_OPTIM_DIR"), std::env::var("TT_OPTIM_ALG"))
    else {
        return;
    };
    let (_, alg, schedule) = algorithms()
        .into_iter()
        .find(|(n, _, _)| *n == which)
        .unwrap();
    let (vs, net, mut opt) = fresh(1, alg, schedule);
    train(&net, &mut opt, 0..HALF);
    let mut ckpt = Checkpoint::new(opt.steps());
    ckpt.add_var_store(&vs).unwrap();
    opt.save_into(&mut ckpt, "optim").unwrap();
    CheckpointDir::open(&dir).unwrap().save(&ckpt).unwrap();
    println!("saved");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

#[test]
fn a_killed_and_resumed_run_ends_exactly_like_an_uninterrupted_one() {
    for (name, alg, schedule) in algorithms() {
        let (vs_full, net_full, mut opt_full) = fresh(1, alg, schedule);
        train(&net_full, &mut opt_full, 0..2 * HALF);

        let root = tempfile::tempdir().unwrap();
        let mut child = tt_testkit::rerun("resume_child")
            .env("TT_OPTIM_DIR", root.path())
            .env("TT_OPTIM_ALG", name)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(
            lines.any(|l| l.unwrap().contains("saved")),
            "{name}: the child never saved"
        );
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        // A new process would start from other random weights and a fresh optimizer.
        let (mut vs, net, mut opt) =
            fresh(99, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant);
        let loaded = CheckpointDir::open(root.path())
            .unwrap()
            .load_latest()
            .unwrap()
            .unwrap()
            .checkpoint;
        loaded.load_var_store(&mut vs).unwrap();
        opt.load_from(&loaded, "optim").unwrap();
        assert_eq!(opt.steps(), HALF as u64);
        train(&net, &mut opt, HALF..2 * HALF);
        for (var, full) in vs_full.variables() {
            assert!(
                vs.variables()[&var].equal(&full),
                "{name}: {var} differs after resume"
            );
        }

        // Without the optimizer state the same resume ends elsewhere: the state matters.
        let (mut vs2, net2, _) = fresh(99, alg, schedule);
        loaded.load_var_store(&mut vs2).unwrap();
        let mut stateless = Optimizer::new(&vs2, alg, schedule).unwrap();
        train(&net2, &mut stateless, HALF..2 * HALF);
        let differs = vs_full
            .variables()
            .iter()
            .any(|(var, full)| !vs2.variables()[var].equal(full));
        assert!(
            differs,
            "{name}: dropping the optimizer state should change the result"
        );
    }
}

#[test]
fn a_state_for_other_parameters_is_refused() {
    let (vs, net, mut opt) = fresh(1, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant);
    train(&net, &mut opt, 0..2);
    let mut ckpt = Checkpoint::new(2);
    opt.save_into(&mut ckpt, "optim").unwrap();
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("c.safetensors");
    ckpt.write_to(&path).unwrap();
    let loaded = tt_ckpt::LoadedCheckpoint::read(&path).unwrap();
    let other = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(other.root() / "other", 2, 2, Default::default());
    let mut opt2 = Optimizer::adam(&other, AdamConfig::adam()).unwrap();
    let e = opt2.load_from(&loaded, "optim").err().unwrap();
    assert!(e.to_string().contains("saved for parameters"), "{e}");
    drop(vs);
}

#[test]
fn invalid_hyper_parameters_are_refused_like_torch() {
    let vs = nn::VarStore::new(Device::Cpu);
    for alg in [
        Algorithm::Sgd(SgdConfig {
            lr: -1.0,
            ..Default::default()
        }),
        Algorithm::Sgd(SgdConfig {
            nesterov: true,
            ..Default::default()
        }),
        Algorithm::Adam(AdamConfig {
            betas: (1.0, 0.999),
            ..AdamConfig::adam()
        }),
        Algorithm::AdamW(AdamConfig {
            eps: f64::NAN,
            ..AdamConfig::adamw()
        }),
    ] {
        let e = Optimizer::new(&vs, alg, Schedule::Constant).err().unwrap();
        assert!(
            e.to_string().starts_with("invalid optimizer configuration"),
            "{e}"
        );
    }
}
