//! GPU tests of the trainer (`cargo xtask test-gpu`; they fail without CUDA): fp16 loss
//! scaling on CUDA, where float16's range really overflows, and a run with Adam's
//! moments on the GPU crashed, resumed from its checkpoint and ending bit for bit where
//! an uninterrupted run ends; the adaptive micro-batch on CUDA's own out-of-memory error.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::collections::BTreeMap;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tt_ckpt::LoadedCheckpoint;
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule, SgdConfig};
use tt_train::{Precision, Steps, TrainConfig, Trainer};

/// The step whose loss is made infinite.
const INF_AT: u64 = 5;
/// `torch.amp.GradScaler`'s: the scale doubles after this many good steps in a row.
const GROWTH_INTERVAL: u64 = 2000;

/// The trainer's scaler in checkpoint `path`: `(scale, good steps since it changed)`.
fn scaler_in(path: &std::path::Path) -> (f64, u64) {
    let loaded = LoadedCheckpoint::read(path).unwrap();
    let values: serde_json::Value = loaded.value("values").unwrap();
    serde_json::from_value(values["tt_train.grad_scaler"].clone())
        .unwrap_or_else(|e| panic!("no scaler in {}: {e} ({values})", path.display()))
}

/// One CUDA process, fp16, a loss that is infinite at step [`INF_AT`] and small
/// otherwise (so that no other step overflows, at 65536 or after growth): that step is
/// skipped and halves the scale to 32768, which doubles back after 2000 good steps. The
/// checkpoint of step 1000 holds the halved scale, the parameters stay finite and the
/// loss after the skipped step is finite.
#[test]
fn fp16_on_cuda_skips_an_overflowing_step_halves_the_scale_and_grows_it_back() {
    tt_sys::require_cuda();
    let dev = Device::Cuda(0);
    let dir = tempfile::tempdir().unwrap();
    // 64 samples in batches of 4: 16 steps an epoch; 126 epochs = 2016 steps.
    let mut cfg = TrainConfig::new(64, 4, 126)
        .precision(Precision::Fp16)
        .checkpoints(dir.path(), 1000);
    cfg = cfg.handle_signals(false);
    cfg = cfg.progress(false);
    cfg = cfg.log_every(1000);
    cfg = cfg.keep_last(5);
    let mut trainer = Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), dev).unwrap();
    tch::manual_seed(3);
    let mut vs = nn::VarStore::new(dev);
    let net = nn::linear(vs.root(), 8, 1, Default::default());
    let mut opt = Optimizer::sgd(&vs, SgdConfig::default()).unwrap();
    let forward_kind = std::cell::Cell::new(None);
    let report = trainer
        .fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                let idx: Vec<f32> = ctx.indices.iter().map(|&i| i as f32).collect();
                let i = Tensor::from_slice(&idx).to_device(ctx.device).unsqueeze(1);
                let freq = Tensor::arange(8, (Kind::Float, ctx.device)).unsqueeze(0) + 1.0;
                let x = (&i * &freq * 0.05).sin();
                let y = (&i * 0.1).cos();
                let out = net.forward(&x);
                forward_kind.set(Some(out.kind()));
                let loss = out.to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean) * 1e-3;
                Ok::<_, tch::TchError>(if ctx.step == INF_AT {
                    loss * f64::INFINITY
                } else {
                    loss
                })
            }),
        )
        .unwrap();
    println!("{report:?}");
    assert_eq!(
        forward_kind.get(),
        Some(Kind::Half),
        "the forward pass ran in float16"
    );
    assert_eq!(report.steps, 2016);
    assert_eq!(report.skipped_steps, 1, "only the infinite step is skipped");
    // 65536 halved by the skip, doubled after 2000 good steps.
    assert_eq!(report.loss_scale, Some(65536.0));
    let at_1000 = scaler_in(&dir.path().join("ckpt-00001000.safetensors"));
    assert_eq!(at_1000.0, 32768.0, "the halved scale is in the checkpoint");
    // Steps 0..1000 ran; step INF_AT (0-based) was skipped.
    assert_eq!(at_1000.1, 1000 - INF_AT - 1, "good steps since the skip");
    let at_2000 = scaler_in(&dir.path().join("ckpt-00002000.safetensors"));
    assert_eq!(at_2000.0, 32768.0, "not grown before 2000 good steps");
    // Step INF_AT + GROWTH_INTERVAL doubled it and started counting again.
    let last = report.checkpoint.clone().expect("a final checkpoint");
    let (scale, good) = scaler_in(&last);
    assert_eq!(scale, 65536.0, "{}", last.display());
    assert_eq!(good, 2016 - INF_AT - 1 - GROWTH_INTERVAL);
    let (_, final_loss) = *report.losses.last().unwrap();
    assert!(
        final_loss.is_finite() && final_loss > 0.0,
        "{:?}",
        report.losses
    );
    for (name, t) in vs.variables() {
        assert_eq!(t.device(), dev);
        assert!(
            t.isfinite().all().int64_value(&[]) == 1,
            "{name} is not finite"
        );
    }
}

/// Trains a 8-64-1 network with Adam on cuda:0 for 3 epochs of 16 steps, checkpointing
/// every 5 steps into `ckpt`; fails at step `crash_at` when given. The parameters.
fn adam_on_cuda(ckpt: &std::path::Path, crash_at: Option<u64>) -> Option<Vec<(String, Tensor)>> {
    let dev = Device::Cuda(0);
    let mut cfg = TrainConfig::new(64, 4, 3).seed(7).checkpoints(ckpt, 5);
    cfg = cfg.handle_signals(false);
    cfg = cfg.progress(false);
    let mut trainer = Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), dev).unwrap();
    tch::manual_seed(11);
    let mut vs = nn::VarStore::new(dev);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 8, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 1, Default::default()));
    let mut opt =
        Optimizer::new(&vs, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant).unwrap();
    let result = trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            if Some(ctx.step) == crash_at {
                return Err(std::io::Error::other("crash"));
            }
            let idx: Vec<f32> = ctx.indices.iter().map(|&i| i as f32).collect();
            let i = Tensor::from_slice(&idx).to_device(ctx.device).unsqueeze(1);
            let x = (&i * (Tensor::arange(8, (Kind::Float, ctx.device)) + 1.0) * 0.05).sin();
            Ok(net
                .forward(&x)
                .mse_loss(&(&i * 0.1).cos(), tch::Reduction::Mean))
        }),
    );
    match (result, crash_at) {
        (Ok(report), None) => {
            assert_eq!(report.steps, 48);
            // By name: `variables()` is a hash map, in no fixed order.
            let mut params: Vec<(String, Tensor)> = vs
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.copy()))
                .collect();
            params.sort_by(|a, b| a.0.cmp(&b.0));
            Some(params)
        }
        (Err(tt_train::TrainError::Step { .. }), Some(_)) => None,
        (other, _) => panic!("fit: {other:?}"),
    }
}

#[test]
fn adam_state_on_cuda_is_checkpointed_and_resumed_bit_for_bit() {
    tt_sys::require_cuda();
    let dir = tempfile::tempdir().unwrap();
    let whole = adam_on_cuda(&dir.path().join("whole"), None).unwrap();
    let ckpt = dir.path().join("crashed");
    assert!(adam_on_cuda(&ckpt, Some(23)).is_none());
    // The checkpoint of step 20 holds Adam's moments, saved from the GPU.
    let loaded = LoadedCheckpoint::read(ckpt.join("ckpt-00000020.safetensors")).unwrap();
    let names = loaded.tensors().names();
    assert!(
        names.iter().filter(|n| n.contains("exp_avg")).count() >= 4,
        "Adam's moments are not in the checkpoint: {names:?}"
    );
    let resumed = adam_on_cuda(&ckpt, None).unwrap();
    assert_eq!(whole.len(), resumed.len());
    for ((name, a), (other, b)) in whole.iter().zip(&resumed) {
        assert_eq!(name, other);
        assert_eq!(a.device(), Device::Cuda(0));
        assert!(a.equal(b), "{name} differs after the resume");
    }
}

/// The memory test's model: 8 features, a hidden layer this wide, one output.
const WIDE: i64 = 8192;
/// The memory test's batch: its activations (two float tensors of `BIG x WIDE`, 512
/// MiB each, and their gradients) need about 2 GiB at the peak.
const BIG: usize = 16384;

/// Two steps of [`BIG`] through the wide model with everything but `free` bytes of the
/// GPU taken by a filler tensor; `adaptive` finds the micro-batch, else `accumulate`
/// micro-batches. Returns the parameters by name and the micro-batches per step.
fn wide_on_cuda(free: u64, accumulate: Option<usize>) -> (BTreeMap<String, Tensor>, usize) {
    let dev = Device::Cuda(0);
    let mut cfg = TrainConfig::new(2 * BIG as u64, BIG, 1)
        .seed(3)
        .handle_signals(false)
        .progress(false);
    cfg = match accumulate {
        Some(k) => cfg.accumulate(k),
        None => cfg.adaptive_micro_batch(true),
    };
    let mut trainer = Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), dev).unwrap();
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(dev);
    let l1 = nn::linear(vs.root() / "l1", 8, WIDE, Default::default());
    let l2 = nn::linear(vs.root() / "l2", WIDE, 1, Default::default());
    let mut opt = Optimizer::sgd(&vs, SgdConfig::default()).unwrap();
    let info = tt_sys::mem_get_info(0).unwrap();
    let filler = Tensor::empty([info.free.saturating_sub(free) as i64], (Kind::Uint8, dev));
    let mut parts = 0;
    let work = Steps::new(|ctx| -> Result<Tensor, tch::TchError> {
        parts = ctx.micro_batches;
        let idx: Vec<f32> = ctx.indices.iter().map(|&i| i as f32).collect();
        let i = Tensor::from_slice(&idx).f_to_device(dev)?.f_unsqueeze(1)?;
        let x = (&i * (Tensor::arange(8, (Kind::Float, dev)) + 1.0) * 1e-4).f_sin()?;
        let h = x.f_linear(&l1.ws, l1.bs.as_ref())?.f_relu()?;
        h.f_linear(&l2.ws, l2.bs.as_ref())?
            .f_mse_loss(&(&i * 1e-4).f_cos()?, tch::Reduction::Mean)
    });
    let report = trainer.fit(&mut vs, &mut opt, work).unwrap();
    drop(filler);
    assert_eq!(report.steps, 2);
    let params = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cpu)))
        .collect();
    (params, parts)
}

/// With 1 GiB of the GPU left, a batch needing about 2 GiB runs out of CUDA memory
/// (CUDA's own error, classified by tt-adaptive): the trainer halves the micro-batch
/// until it fits and ends with the parameters of a run accumulating as many fixed
/// micro-batches.
#[test]
fn the_adaptive_micro_batch_halves_on_a_real_cuda_out_of_memory() {
    tt_sys::require_cuda();
    const GIB: u64 = 1 << 30;
    let (found, parts) = wide_on_cuda(GIB, None);
    assert!(
        parts >= 2,
        "the whole batch fit in 1 GiB ({parts} micro-batches)"
    );
    let (fixed, same) = wide_on_cuda(GIB, Some(parts));
    assert_eq!(same, parts);
    assert_eq!(found.len(), 4, "l1 and l2, weights and biases");
    for (name, a) in &found {
        let diff = (a - &fixed[name]).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{name} differs by {diff}");
    }
}
