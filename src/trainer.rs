//! The unified trainer: one training loop for one process or many (torchhandy's
//! `Parallel_Trainer`, with what it lacks: multi-node, resumable sampling, optimizer
//! state in checkpoints, barriers, preemption).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::nn::VarStore;
use tch::{Device, Tensor};
use tt_ckpt::CheckpointDir;
use tt_dist::{Ddp, ProcessGroup, ReduceOp};
use tt_optim::Optimizer;
use tt_sampler::{BatchSampler, DistributedSampler, Reshard, SamplerState};

/// Errors of the [`Trainer`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A configuration value is unusable.
    #[error("trainer configuration: {0}")]
    Config(String),
    /// Forming the group or a collective failed.
    #[error(transparent)]
    Dist(#[from] tt_dist::Error),
    /// Choosing the device failed.
    #[error(transparent)]
    Device(#[from] tt_device::Error),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] tt_ckpt::Error),
    /// The optimizer failed (or its saved state did not fit).
    #[error(transparent)]
    Optim(#[from] tt_optim::Error),
    /// The sampler refused a state or a shape.
    #[error(transparent)]
    Sampler(#[from] tt_sampler::Error),
    /// The step function failed at `step`.
    #[error("training step {step} failed: {message}")]
    Step {
        /// The step (0-based count of finished steps before it).
        step: u64,
        /// Its error.
        message: String,
    },
    /// Installing the SIGTERM / SIGINT handlers failed.
    #[error("cannot install the preemption signal handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// What to train on and how often to checkpoint.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TrainConfig {
    /// Samples in the dataset (indices `0..dataset_len` are handed to the step).
    pub dataset_len: u64,
    /// Samples per step on each rank.
    pub batch_size: usize,
    /// Epochs to train.
    pub epochs: u64,
    /// Shuffle seed (torch's `DistributedSampler` order for this seed).
    pub seed: u64,
    /// Shuffle each epoch (torch's default), or keep index order.
    pub shuffle: bool,
    /// Where checkpoints go (rank 0 writes, every rank resumes from it); `None`: no
    /// checkpoints and no resume.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end and on preemption).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep_last: usize,
    /// Average the loss over the ranks and log it (rank 0) every this many steps.
    pub log_every: u64,
}

impl TrainConfig {
    /// `epochs` over `dataset_len` samples, `batch_size` per rank, seed 0, shuffled,
    /// no checkpoints, a log line every 50 steps.
    pub fn new(dataset_len: u64, batch_size: usize, epochs: u64) -> TrainConfig {
        TrainConfig {
            dataset_len,
            batch_size,
            epochs,
            seed: 0,
            shuffle: true,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_last: 3,
            log_every: 50,
        }
    }

    /// Checkpoints in `dir` every `every` steps (0: at the end and on preemption).
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>, every: u64) -> TrainConfig {
        self.checkpoint_dir = Some(dir.into());
        self.checkpoint_every = every;
        self
    }

    /// With this shuffle seed.
    pub fn seed(mut self, seed: u64) -> TrainConfig {
        self.seed = seed;
        self
    }

    fn validate(&self) -> Result<(), TrainError> {
        if self.dataset_len == 0 {
            return Err(TrainError::Config(
                "dataset_len is 0: give the number of samples".into(),
            ));
        }
        if self.batch_size == 0 {
            return Err(TrainError::Config(
                "batch_size is 0: give the samples per step on each rank".into(),
            ));
        }
        if self.log_every == 0 {
            return Err(TrainError::Config(
                "log_every is 0: give a number of steps (e.g. 50)".into(),
            ));
        }
        if self.keep_last == 0 {
            return Err(TrainError::Config(
                "keep_last is 0: keep at least one checkpoint".into(),
            ));
        }
        Ok(())
    }
}

/// What the step function gets.
#[derive(Debug)]
pub struct StepContext<'a> {
    /// This rank's sample indices for this step.
    pub indices: &'a [u64],
    /// This process's device (per `LOCAL_RANK`).
    pub device: Device,
    /// The epoch.
    pub epoch: u64,
    /// Steps finished before this one (over the whole run, resumes included).
    pub step: u64,
}

/// Why [`Trainer::fit`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitOutcome {
    /// Every epoch is done.
    Finished,
    /// SIGTERM or SIGINT reached some rank: the step in flight finished, a
    /// checkpoint was written (when a directory is configured) and every rank
    /// stopped at the same step. Start the same command again to resume.
    Preempted,
}

/// What [`Trainer::fit`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    /// Finished or preempted.
    pub outcome: FitOutcome,
    /// Steps finished in all (resumes included).
    pub steps: u64,
    /// The epoch it stopped in (or `epochs` when finished).
    pub epoch: u64,
    /// The checkpoint step it resumed from, if any.
    pub resumed_from: Option<u64>,
    /// `(step, loss averaged over the ranks)` every `log_every` steps and at the end.
    pub losses: Vec<(u64, f64)>,
    /// The last checkpoint written (rank 0 only; `None` elsewhere).
    pub checkpoint: Option<PathBuf>,
}

/// One training loop for one process or many.
///
/// Started plainly (`cargo run`), it is a group of one on this process's device;
/// started by `torchtools launch --nproc-per-node N` or `torchrun --no-python`, every
/// process is a rank of a c10d group (Gloo on CPU, NCCL on CUDA), on the GPU of its
/// `LOCAL_RANK`. The same code runs in both. [`Trainer::fit`]:
///
/// - shards the dataset with torch's `DistributedSampler` order (tt-sampler);
/// - keeps the model replicas identical ([`Ddp`]: rank-0 broadcast, averaged gradients);
/// - resumes from the newest valid checkpoint in [`TrainConfig::checkpoint_dir`]:
///   parameters, optimizer state (tt-optim) and sampler position, so the resumed run
///   ends with the parameters of an uninterrupted one;
/// - averages the loss over the ranks for logging (rank 0 logs through `tracing`);
/// - checkpoints on rank 0 only, then meets at a barrier;
/// - on SIGTERM / SIGINT (a scheduler cycling jobs) finishes the step, agrees with
///   every rank to stop at the same one, checkpoints and returns
///   [`FitOutcome::Preempted`]; a second signal exits at once (status 128 + signal).
///
/// # Example
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch::{Kind, Tensor};
/// use torchtools::trainer::{TrainConfig, Trainer};
/// use torchtools::optim::{Optimizer, SgdConfig};
///
/// let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3).checkpoints("ckpt", 100))?;
/// let mut vs = nn::VarStore::new(trainer.device());
/// let net = nn::linear(vs.root(), 8, 1, Default::default());
/// let mut opt = Optimizer::sgd(&vs, SgdConfig { lr: 0.1, ..Default::default() })?;
/// let report = trainer.fit(&mut vs, &mut opt, |ctx| {
///     let idx = Tensor::from_slice(&ctx.indices.iter().map(|&i| i as f32).collect::<Vec<_>>());
///     let x = (idx.unsqueeze(1) * Tensor::ones([1, 8], (Kind::Float, ctx.device))).sin();
///     net.forward(&x).pow_tensor_scalar(2).f_mean(Kind::Float)
/// })?;
/// if trainer.is_main() {
///     println!("{:?} after {} steps", report.outcome, report.steps);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Trainer {
    pg: Arc<ProcessGroup>,
    device: Device,
    config: TrainConfig,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("device", &self.device)
            .finish()
    }
}

impl Trainer {
    /// The group from the environment ([`ProcessGroup::from_env`]), the device from
    /// tt-device (`TORCHTOOLS_DEVICE`, `LOCAL_RANK`), and the signal handlers.
    pub fn from_env(config: TrainConfig) -> Result<Trainer, TrainError> {
        config.validate()?;
        let device = tt_device::select()?;
        let pg = ProcessGroup::from_env()?;
        Trainer::with_group(config, pg, device)
    }

    /// With a group and device of your own.
    pub fn with_group(
        config: TrainConfig,
        pg: ProcessGroup,
        device: Device,
    ) -> Result<Trainer, TrainError> {
        config.validate()?;
        let stop = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            // A second signal (the flag already set) exits at once.
            signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&stop))
                .map_err(TrainError::Signal)?;
            signal_hook::flag::register(sig, Arc::clone(&stop)).map_err(TrainError::Signal)?;
        }
        Ok(Trainer {
            pg: Arc::new(pg),
            device,
            config,
            stop,
        })
    }

    /// This process's device: put the model's VarStore there.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Whether this is rank 0 (which logs and checkpoints).
    pub fn is_main(&self) -> bool {
        self.pg.is_main()
    }

    /// Asks the loop to stop after the current step, as SIGTERM does.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// A hook for [`tt_adaptive::Adaptive::agree`]: every rank starts from the
    /// smallest batch size any rank found (a collective: all ranks must call the
    /// adaptive function together). If the collective fails, the rank keeps its own
    /// size and the failure surfaces at the next collective.
    pub fn batch_agreement(&self) -> impl Fn(usize) -> usize + Send + Sync + 'static {
        let pg = Arc::clone(&self.pg);
        move |mine| match pg.min_over_ranks(mine as u64) {
            Ok(v) => usize::try_from(v).unwrap_or(mine),
            Err(e) => {
                tracing::warn!("batch-size agreement failed: {e}");
                mine
            }
        }
    }

    /// Trains `vs` with `opt`; `step` computes this rank's loss for a batch of sample
    /// indices. See [`Trainer`] for what happens around it.
    pub fn fit<F>(
        &mut self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        mut step: F,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, tch::TchError>,
    {
        let cfg = self.config.clone();
        let pg = Arc::clone(&self.pg);
        let sampler =
            DistributedSampler::new(cfg.dataset_len, pg.world_size() as u64, pg.rank() as u64)?
                .with_shuffle(cfg.shuffle)
                .with_seed(cfg.seed);
        let mut batches = BatchSampler::new(sampler, cfg.batch_size, false)?;
        let dir = match &cfg.checkpoint_dir {
            Some(d) => Some(
                CheckpointDir::open(d)?
                    .keep_last(cfg.keep_last)
                    .writer(pg.is_main()),
            ),
            None => None,
        };
        // Resume: every rank reads the same file, so all agree without a broadcast.
        let mut steps = 0u64;
        let mut resumed_from = None;
        if let Some(dir) = &dir {
            if !dir.list()?.is_empty() {
                let loaded = dir.load_latest()?;
                for (path, why) in &loaded.skipped {
                    tracing::warn!("skipped checkpoint {}: {why}", path.display());
                }
                let ckpt = loaded.checkpoint;
                ckpt.load_var_store(vs)?;
                opt.load_from(&ckpt, "optim")?;
                let state: SamplerState = ckpt.value("sampler")?;
                batches.sampler_mut().load_state(&state, Reshard::Allow)?;
                steps = ckpt.step();
                resumed_from = Some(steps);
                if pg.is_main() {
                    tracing::info!(
                        step = steps,
                        epoch = state.epoch,
                        "resumed from {}",
                        ckpt.path().display()
                    );
                }
            }
        }
        let ddp = Ddp::new(&pg, vs)?;
        let mut losses = Vec::new();
        let mut last_ckpt = None;
        let mut window = (0.0f64, 0u64);
        loop {
            let epoch = batches.sampler().epoch();
            if epoch >= cfg.epochs {
                break;
            }
            let Some(batch) = batches.next_batch()? else {
                batches.sampler_mut().set_epoch(epoch + 1);
                continue;
            };
            opt.zero_grad();
            let ctx = StepContext {
                indices: &batch,
                device: self.device,
                epoch,
                step: steps,
            };
            let loss = step(&ctx).map_err(|e| TrainError::Step {
                step: steps,
                message: e.to_string(),
            })?;
            let loss_value = loss.f_double_value(&[]).map_err(|e| TrainError::Step {
                step: steps,
                message: format!("the loss must be a scalar tensor: {e}"),
            })?;
            ddp.backward(&loss)?;
            opt.step()?;
            steps += 1;
            // One small all-reduce a step: the loss summed over the ranks (for the log)
            // and whether any rank was signalled, so that all stop after the same step.
            let stop_here = self.stop.load(Ordering::SeqCst);
            let flags = Tensor::from_slice(&[loss_value, f64::from(u8::from(stop_here))]);
            pg.all_reduce(&flags, ReduceOp::Sum)?;
            let any_stop = flags.double_value(&[1]) > 0.0;
            window.0 += flags.double_value(&[0]) / pg.world_size() as f64;
            window.1 += 1;
            if steps % cfg.log_every == 0 || any_stop {
                let mean = window.0 / window.1 as f64;
                window = (0.0, 0);
                losses.push((steps, mean));
                if pg.is_main() {
                    tracing::info!(step = steps, epoch, loss = mean, "training");
                }
            }
            if any_stop {
                if let Some(dir) = &dir {
                    last_ckpt = save(&pg, dir, vs, opt, &batches, steps)?;
                }
                pg.barrier()?;
                if pg.is_main() {
                    tracing::info!(step = steps, "preempted: checkpoint written, stopping");
                }
                return Ok(FitReport {
                    outcome: FitOutcome::Preempted,
                    steps,
                    epoch,
                    resumed_from,
                    losses,
                    checkpoint: last_ckpt,
                });
            }
            if cfg.checkpoint_every > 0 && steps % cfg.checkpoint_every == 0 {
                if let Some(dir) = &dir {
                    last_ckpt = save(&pg, dir, vs, opt, &batches, steps)?;
                }
            }
        }
        if window.1 > 0 {
            let mean = window.0 / window.1 as f64;
            losses.push((steps, mean));
        }
        if let Some(dir) = &dir {
            last_ckpt = save(&pg, dir, vs, opt, &batches, steps)?;
        }
        pg.barrier()?;
        Ok(FitReport {
            outcome: FitOutcome::Finished,
            steps,
            epoch: cfg.epochs,
            resumed_from,
            losses,
            checkpoint: last_ckpt,
        })
    }
}

/// Rank 0 writes; the others return `None` without building anything.
fn save(
    pg: &ProcessGroup,
    dir: &CheckpointDir,
    vs: &VarStore,
    opt: &Optimizer,
    batches: &BatchSampler,
    steps: u64,
) -> Result<Option<PathBuf>, TrainError> {
    if !pg.is_main() {
        return Ok(None);
    }
    let state = batches.state();
    let mut ckpt = dir.checkpoint(steps).with_epoch(state.epoch);
    ckpt.add_var_store(vs)?;
    opt.save_into(&mut ckpt, "optim")?;
    ckpt.set_value("sampler", &state)?;
    Ok(dir.save(&ckpt)?)
}
