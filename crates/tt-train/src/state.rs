//! Everything a resumed run needs, saved and loaded in one call.

use std::path::PathBuf;

use tch::nn::VarStore;
use tt_ckpt::CheckpointDir;
use tt_optim::Optimizer;
use tt_sampler::{Reshard, SamplerState};

use crate::{EpochBatches, TrainError};

/// The optimizer's entries in a checkpoint (the first optimizer's; the others' are
/// `optim.1`, `optim.2`, ...).
const OPTIM: &str = "optim";

/// The entries of the `i`-th optimizer of a step.
fn optim_key(i: usize) -> String {
    match i {
        0 => OPTIM.to_owned(),
        i => format!("{OPTIM}.{i}"),
    }
}
/// The sampler's entry in a checkpoint.
const SAMPLER: &str = "sampler";
/// The entry of [`TrainState::values`] in a checkpoint.
const VALUES: &str = "values";

/// The trainer's best evaluation `(step, value)` in a checkpoint's values.
pub(crate) const BEST: &str = "tt_train.best_eval";
/// The fp16 [`GradScaler`](crate::GradScaler)'s state in a checkpoint's values.
pub(crate) const SCALER: &str = "tt_train.grad_scaler";

/// The micro-batch the adaptive search found (`TrainConfig::adaptive_micro_batch`).
pub(crate) const MICRO: &str = "tt_train.micro_batch";

/// The trainer's value `key` in a checkpoint's values, if there and readable.
pub(crate) fn saved<T: serde::de::DeserializeOwned>(values: &Values, key: &str) -> Option<T> {
    values
        .get(key)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

/// [`TrainState::values`]: your own values, by name.
pub type Values = std::collections::BTreeMap<String, serde_json::Value>;

/// A training loop's state: the model's parameters, the optimizer (its moments, step
/// count and learning-rate schedule) and the position in the data, saved together
/// and resumed together, so that an interrupted run continues exactly as if it never
/// stopped: the Python cycling_utils' `AtomicDirectory` + `InterruptableDistributedSampler`
/// + the optimizer's `state_dict`, as one value.
///
/// For a loop of your own; the [`Trainer`](crate::Trainer) does this by itself.
///
/// ```
/// use tch::nn::{self, Module};
/// use tch::{Device, Kind, Tensor};
/// use tt_ckpt::CheckpointDir;
/// use tt_optim::{Optimizer, SgdConfig};
/// use tt_sampler::DistributedSampler;
/// use tt_train::{EpochBatches, TrainState};
///
/// let root = tempfile::tempdir()?;
/// let dir = CheckpointDir::open(root.path())?;
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = nn::linear(vs.root(), 4, 1, Default::default());
/// let optimizer = Optimizer::sgd(&vs, SgdConfig { lr: 0.1, ..Default::default() })?;
/// let batches = EpochBatches::new(DistributedSampler::new(64, 1, 0)?, 8, 2)?;
/// let mut state = TrainState::new(vs, optimizer, batches);
///
/// // None on a first run; the step it continues from after an interruption.
/// if let Some(step) = state.resume(&dir)? {
///     println!("resumed at step {step}");
/// }
/// while let Some(batch) = state.batches.next_batch()? {
///     let idx: Vec<f32> = batch.indices.iter().map(|&i| i as f32 / 64.0).collect();
///     let x = Tensor::from_slice(&idx).unsqueeze(1).repeat([1, 4]);
///     let loss = net.forward(&x).pow_tensor_scalar(2).mean(Kind::Float);
///     state.optimizer.backward_step(&loss)?;
///     state.step += 1;
///     if state.step % 5 == 0 {
///         state.save(&dir)?;
///     }
/// }
/// assert_eq!(state.step, 16);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TrainState {
    /// The model's parameters.
    pub vs: VarStore,
    /// The optimizer over `vs`.
    pub optimizer: Optimizer,
    /// The batches still to train on.
    pub batches: EpochBatches,
    /// Steps finished (over the whole run, resumes included).
    pub step: u64,
    /// Values of your own, saved with the state and restored by [`resume`](Self::resume)
    /// (empty after a resume from a checkpoint that has none): what else the loop
    /// needs to continue exactly, such as the micro-batch size an out-of-memory-adaptive
    /// step settled on, so that the resumed run sums its gradients in the same order.
    pub values: Values,
    reshard: Reshard,
}

impl std::fmt::Debug for TrainState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainState")
            .field("step", &self.step)
            .field("values", &self.values)
            .field("optimizer_steps", &self.optimizer.steps())
            .field("batches", &self.batches)
            .field("reshard", &self.reshard)
            .finish_non_exhaustive()
    }
}

impl TrainState {
    /// A state at step 0.
    pub fn new(vs: VarStore, optimizer: Optimizer, batches: EpochBatches) -> TrainState {
        TrainState {
            vs,
            optimizer,
            batches,
            step: 0,
            values: Values::new(),
            reshard: Reshard::Refuse,
        }
    }

    /// How to treat a checkpoint written by another number of processes (default:
    /// [`Reshard::Refuse`], an error naming both sizes).
    pub fn reshard(mut self, reshard: Reshard) -> TrainState {
        self.reshard = reshard;
        self
    }

    /// Loads the newest valid checkpoint of `dir` into the parameters, the optimizer
    /// and the batches; returns its step, or `None` when `dir` has none yet. Damaged
    /// newer files are skipped (and logged).
    pub fn resume(&mut self, dir: &CheckpointDir) -> Result<Option<u64>, TrainError> {
        let resumed = resume_parts(
            dir,
            &mut self.vs,
            std::slice::from_mut(&mut self.optimizer),
            &mut self.batches,
            self.reshard,
            Some(&mut self.values),
        )?;
        if let Some(step) = resumed {
            self.step = step;
        }
        Ok(resumed)
    }

    /// Saves parameters, optimizer and position as checkpoint `self.step` in `dir`;
    /// returns its path (`None` when `dir` is not the writer, as on ranks other than
    /// 0).
    pub fn save(&self, dir: &CheckpointDir) -> Result<Option<PathBuf>, TrainError> {
        save_parts(
            dir,
            self.step,
            &self.vs,
            std::slice::from_ref(&self.optimizer),
            &self.batches,
            &self.values,
        )
    }
}

/// The parts as checkpoint `step` (CUDA tensors still landing in host memory).
fn parts_checkpoint(
    dir: &CheckpointDir,
    step: u64,
    vs: &VarStore,
    optimizers: &[Optimizer],
    batches: &EpochBatches,
    values: &Values,
) -> Result<tt_ckpt::Checkpoint<'static>, TrainError> {
    let state = batches.state();
    let mut ckpt = dir.checkpoint(step).with_epoch(state.epoch);
    ckpt.add_var_store(vs)?;
    for (i, optimizer) in optimizers.iter().enumerate() {
        optimizer.save_into(&mut ckpt, &optim_key(i))?;
    }
    ckpt.set_value(SAMPLER, &state)?;
    if !values.is_empty() {
        ckpt.set_value(VALUES, values)?;
    }
    Ok(ckpt)
}

/// Saves the parts as checkpoint `step`.
pub(crate) fn save_parts(
    dir: &CheckpointDir,
    step: u64,
    vs: &VarStore,
    optimizers: &[Optimizer],
    batches: &EpochBatches,
    values: &Values,
) -> Result<Option<PathBuf>, TrainError> {
    let ckpt = parts_checkpoint(dir, step, vs, optimizers, batches, values)?;
    Ok(dir.save(&ckpt)?)
}

/// Starts saving the parts as checkpoint `step` in the background
/// (`CheckpointDir::save_async`): training goes on while the file is written; the next
/// save, `wait()` or the directory's drop finishes it, and its failure comes back there.
pub(crate) fn save_parts_async(
    dir: &CheckpointDir,
    step: u64,
    vs: &VarStore,
    optimizers: &[Optimizer],
    batches: &EpochBatches,
    values: &Values,
) -> Result<(), TrainError> {
    let ckpt = parts_checkpoint(dir, step, vs, optimizers, batches, values)?;
    Ok(dir.save_async(ckpt)?)
}

/// Loads the newest valid checkpoint into the parts; its step, or `None`.
pub(crate) fn resume_parts(
    dir: &CheckpointDir,
    vs: &mut VarStore,
    optimizers: &mut [Optimizer],
    batches: &mut EpochBatches,
    reshard: Reshard,
    values: Option<&mut Values>,
) -> Result<Option<u64>, TrainError> {
    let Some(loaded) = dir.load_latest()? else {
        return Ok(None);
    };
    for (path, why) in &loaded.skipped {
        tracing::warn!("skipped checkpoint {}: {why}", path.display());
    }
    let ckpt = loaded.checkpoint;
    let state: SamplerState = ckpt.value(SAMPLER)?;
    let now = batches.sampler().num_replicas();
    if state.num_replicas != now && reshard == Reshard::Refuse {
        return Err(TrainError::WorldSizeChanged {
            step: ckpt.step(),
            saved: state.num_replicas,
            now,
        });
    }
    ckpt.load_var_store(vs)?;
    for (i, optimizer) in optimizers.iter_mut().enumerate() {
        optimizer.load_from(&ckpt, &optim_key(i))?;
    }
    batches.load_state(&state, reshard)?;
    if let Some(values) = values {
        *values = if ckpt.meta().values.contains_key(VALUES) {
            ckpt.value(VALUES)?
        } else {
            Values::new()
        };
    }
    tracing::info!(
        step = ckpt.step(),
        epoch = state.epoch,
        "resumed from {}",
        ckpt.path().display()
    );
    Ok(Some(ckpt.step()))
}
