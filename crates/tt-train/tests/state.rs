//! `TrainState` in a loop of one's own: nothing to resume on a first run, an exact
//! resume after an interruption, and a checkpoint of another world size refused.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tt_ckpt::CheckpointDir;
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule};
use tt_sampler::{DistributedSampler, Reshard};
use tt_train::{EpochBatches, TrainError, TrainState};

const SAMPLES: u64 = 40;

/// A fresh state (parameters from `seed`) for rank `rank` of `world`.
fn state(seed: i64, world: u64, rank: u64) -> (TrainState, nn::Sequential) {
    // libtorch's generator is global: tests running beside each other take turns.
    static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = SEEDED.lock().unwrap();
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 4, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", 8, 1, Default::default()));
    let optimizer =
        Optimizer::new(&vs, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant).unwrap();
    let sampler = DistributedSampler::new(SAMPLES, world, rank)
        .unwrap()
        .with_seed(3);
    let batches = EpochBatches::new(sampler, 4, 3).unwrap();
    (TrainState::new(vs, optimizer, batches), net)
}

/// Trains until the batches end or `stop_after` steps; saves every 4 steps.
fn train(state: &mut TrainState, net: &nn::Sequential, dir: &CheckpointDir, stop_after: u64) {
    while state.step < stop_after {
        let Some(batch) = state.batches.next_batch().unwrap() else {
            break;
        };
        let idx: Vec<f32> = batch.indices.iter().map(|&i| i as f32).collect();
        let i = Tensor::from_slice(&idx) / SAMPLES as f64;
        let x = (i.unsqueeze(1) * Tensor::arange(4, (Kind::Float, Device::Cpu))).sin();
        let y = i.unsqueeze(1).cos();
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        state.optimizer.backward_step(&loss).unwrap();
        state.step += 1;
        if state.step % 4 == 0 {
            state.save(dir).unwrap();
        }
    }
}

fn params(state: &TrainState) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = state.vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn an_interrupted_loop_resumes_to_the_uninterrupted_result() {
    let root = tempfile::tempdir().unwrap();
    let whole_dir = CheckpointDir::open(root.path().join("whole")).unwrap();
    let (mut whole, net) = state(1, 1, 0);
    assert_eq!(whole.resume(&whole_dir).unwrap(), None, "nothing yet");
    train(&mut whole, &net, &whole_dir, u64::MAX);
    assert_eq!(whole.step, 30, "3 epochs of 10 batches");

    // Interrupted after step 13 (mid-epoch, one step past the checkpoint at 12).
    let dir = CheckpointDir::open(root.path().join("cut")).unwrap();
    let (mut first, net) = state(1, 1, 0);
    first
        .values
        .insert("micro_batch".into(), serde_json::json!(2));
    train(&mut first, &net, &dir, 13);
    drop(first);
    // A new process: other initial weights, fresh moments, the first batch again.
    let (mut second, net) = state(99, 1, 0);
    assert_eq!(second.resume(&dir).unwrap(), Some(12));
    assert_eq!(second.step, 12);
    assert_eq!(second.optimizer.steps(), 12);
    assert_eq!(second.batches.epoch(), 1);
    assert_eq!(
        second.values.get("micro_batch"),
        Some(&serde_json::json!(2)),
        "the loop's own values come back"
    );
    train(&mut second, &net, &dir, u64::MAX);
    assert_eq!(second.step, 30);
    for ((name, a), (_, b)) in params(&whole).iter().zip(params(&second).iter()) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff == 0.0, "{name} differs by {diff}");
    }
}

#[test]
fn a_checkpoint_of_another_world_size_is_refused_unless_asked() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    let (mut two, net) = state(1, 2, 0);
    train(&mut two, &net, &dir, 4);

    let (mut one, _) = state(1, 1, 0);
    one.values.insert("stale".into(), serde_json::json!(true));
    let e = one.resume(&dir).unwrap_err();
    assert!(
        matches!(
            e,
            TrainError::WorldSizeChanged {
                step: 4,
                saved: 2,
                now: 1
            }
        ),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("2 process(es)") && text.contains("has 1") && text.contains("allow_reshard"),
        "{text}"
    );
    assert_eq!(one.step, 0, "nothing loaded");

    let (one, _) = state(1, 1, 0);
    let mut one = one.reshard(Reshard::Allow);
    one.values.insert("stale".into(), serde_json::json!(true));
    assert_eq!(one.resume(&dir).unwrap(), Some(4));
    assert!(
        one.values.is_empty(),
        "a checkpoint without values clears them"
    );
    // Two ranks had seen 2 x 4 batches of 4 = 32 samples of epoch 0's 40: one rank
    // goes on with the 8 left (2 batches), then 2 whole epochs of 10.
    let mut rest = 0;
    while state_next(&mut one) {
        rest += 1;
    }
    assert_eq!(rest, 2 + 20);
}

fn state_next(state: &mut TrainState) -> bool {
    state.batches.next_batch().unwrap().is_some()
}
