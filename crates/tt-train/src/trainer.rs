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
use tt_sampler::{DistributedSampler, Reshard};

use crate::state::{resume_parts, save_parts, Values};
use crate::{EpochBatches, TrainError};

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
    /// Resume a checkpoint written by another number of processes, continuing its
    /// epoch over this run's ranks (default `false`: refused with
    /// [`TrainError::WorldSizeChanged`], since it changes which samples each rank
    /// sees).
    pub allow_reshard: bool,
    /// Install the process's SIGTERM / SIGINT handlers (default `true`, once per
    /// process: see [`install_signal_handlers`](crate::install_signal_handlers)).
    /// `false` leaves signals to you; [`Trainer::request_stop`] still stops.
    pub handle_signals: bool,
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
            allow_reshard: false,
            handle_signals: true,
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
    /// stopped at the same step. Start the same command again to resume; exit with
    /// [`FitReport::exit_code`] ([`EXIT_PREEMPTED`](crate::EXIT_PREEMPTED)) so that a
    /// launcher or scheduler knows.
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

impl FitReport {
    /// The process's exit status for this outcome: success when finished,
    /// [`EXIT_PREEMPTED`](crate::EXIT_PREEMPTED) (75) when preempted, which
    /// `torchtools launch` passes on without restarting and a scheduler can requeue on.
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self.outcome {
            FitOutcome::Finished => std::process::ExitCode::SUCCESS,
            FitOutcome::Preempted => std::process::ExitCode::from(crate::EXIT_PREEMPTED as u8),
        }
    }
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
///   The handlers are installed once per process by [`Trainer::from_env`] and
///   [`Trainer::with_group`] unless [`TrainConfig::handle_signals`] is `false`.
///
/// # Example
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch::{Kind, Tensor};
/// use tt_optim::{Optimizer, SgdConfig};
/// use tt_train::{TrainConfig, Trainer};
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
/// // Return it from `main`: 0 when finished, 75 when preempted (run it again to resume).
/// let status: std::process::ExitCode = report.exit_code();
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

/// The running loss: summed over the ranks and steps since the last log line, kept on
/// the loss's device (reading it is a host sync on a GPU: done only at log steps).
#[derive(Default)]
struct LossWindow {
    sum: Option<Tensor>,
    steps: u64,
}

impl LossWindow {
    /// Adds one step's loss (a one-element double tensor).
    fn add(&mut self, loss: Tensor) {
        self.sum = Some(match self.sum.take() {
            Some(sum) => sum + loss,
            None => loss,
        });
        self.steps += 1;
    }

    fn take_mean(&mut self) -> Option<f64> {
        let steps = self.steps;
        let mean = self
            .sum
            .take()
            .filter(|_| steps > 0)
            .map(|sum| sum.double_value(&[0]) / steps as f64);
        *self = LossWindow::default();
        mean
    }
}

/// What one loop of [`Trainer::fit`] carries between steps.
struct Run<'a> {
    batches: EpochBatches,
    dir: Option<CheckpointDir>,
    ddp: Ddp<'a>,
    steps: u64,
    resumed_from: Option<u64>,
    losses: Vec<(u64, f64)>,
    window: LossWindow,
    last_ckpt: Option<PathBuf>,
}

impl Trainer {
    /// The group from the environment ([`ProcessGroup::from_env`]), the device from
    /// tt-device (`TORCHTOOLS_DEVICE`, `LOCAL_RANK`), and the signal handlers (once per
    /// process, unless [`TrainConfig::handle_signals`] is `false`).
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
        let stop = if config.handle_signals {
            crate::install_signal_handlers().map_err(TrainError::Signal)?
        } else {
            Arc::new(AtomicBool::new(false))
        };
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

    /// A hook for `tt_adaptive::Adaptive::agree`: every rank starts from the
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
    /// indices (its error, of any type, comes back as [`TrainError::Step`] with the
    /// error as the source). See [`Trainer`] for what happens around it.
    pub fn fit<F, E>(
        &mut self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        mut step: F,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut run = self.start(vs, opt)?;
        while let Some(batch) = run.batches.next_batch()? {
            let loss = self.step(&mut run, opt, &batch.indices, batch.epoch, &mut step)?;
            let any_stop = self.agree(&mut run, loss, batch.epoch)?;
            if any_stop {
                return self.finish(run, vs, opt, FitOutcome::Preempted, batch.epoch);
            }
            if self.config.checkpoint_every > 0 && run.steps % self.config.checkpoint_every == 0 {
                self.checkpoint(&mut run, vs, opt)?;
            }
        }
        if let Some(mean) = run.window.take_mean() {
            run.losses.push((run.steps, mean));
        }
        let epochs = self.config.epochs;
        self.finish(run, vs, opt, FitOutcome::Finished, epochs)
    }

    /// The sampler, the checkpoint directory, the resume, the DDP wrapper.
    fn start<'a>(&'a self, vs: &mut VarStore, opt: &mut Optimizer) -> Result<Run<'a>, TrainError> {
        let cfg = &self.config;
        let pg = &self.pg;
        let sampler =
            DistributedSampler::new(cfg.dataset_len, pg.world_size() as u64, pg.rank() as u64)?
                .with_shuffle(cfg.shuffle)
                .with_seed(cfg.seed);
        let mut batches = EpochBatches::new(sampler, cfg.batch_size, cfg.epochs)?;
        let dir = match &cfg.checkpoint_dir {
            Some(d) => Some(
                CheckpointDir::open(d)?
                    .keep_last(cfg.keep_last)
                    .writer(pg.is_main()),
            ),
            None => None,
        };
        // Every rank reads the same file, so all agree without a broadcast.
        let reshard = if cfg.allow_reshard {
            Reshard::Allow
        } else {
            Reshard::Refuse
        };
        let resumed_from = match &dir {
            Some(dir) => resume_parts(dir, vs, opt, &mut batches, reshard, None)?,
            None => None,
        };
        let ddp = Ddp::new(pg, vs)?;
        Ok(Run {
            batches,
            dir,
            ddp,
            steps: resumed_from.unwrap_or(0),
            resumed_from,
            losses: Vec::new(),
            window: LossWindow::default(),
            last_ckpt: None,
        })
    }

    /// One step: the user's loss, DDP's backward, the optimizer. Returns the loss, as
    /// a one-element double tensor still on its device: nothing here waits for the GPU.
    fn step<F, E>(
        &self,
        run: &mut Run<'_>,
        opt: &mut Optimizer,
        indices: &[u64],
        epoch: u64,
        step: &mut F,
    ) -> Result<Tensor, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        opt.zero_grad();
        let ctx = StepContext {
            indices,
            device: self.device,
            epoch,
            step: run.steps,
        };
        let failed = |source: Box<dyn std::error::Error + Send + Sync>| TrainError::Step {
            step: run.steps,
            source,
        };
        let loss = step(&ctx).map_err(|e| failed(e.into()))?;
        if loss.numel() != 1 {
            return Err(failed(
                format!(
                    "the loss must be a scalar tensor, not one of shape {:?}: reduce it \
                     (e.g. with .mean())",
                    loss.size()
                )
                .into(),
            ));
        }
        let value = loss
            .detach()
            .f_to_kind(tch::Kind::Double)
            .and_then(|l| l.f_reshape([1]))
            .map_err(|e| failed(e.into()))?;
        run.ddp.backward(&loss)?;
        opt.step()?;
        run.steps += 1;
        Ok(value)
    }

    /// One small all-reduce a step: the loss summed over the ranks (for the log) and
    /// whether any rank was signalled, so that all stop after the same step. Logs
    /// every `log_every` steps; returns whether to stop.
    ///
    /// One process alone reads nothing from the device; several read the reduced stop
    /// flag, the step's one host sync (all ranks must agree on when to stop).
    fn agree(&self, run: &mut Run<'_>, loss: Tensor, epoch: u64) -> Result<bool, TrainError> {
        let stop_here = self.stop.load(Ordering::SeqCst);
        let any_stop = if self.pg.backend().is_none() {
            run.window.add(loss);
            stop_here
        } else {
            // On the group's device (NCCL reduces only CUDA tensors); the flag is
            // written there by a kernel, not copied from the host (a copy would wait).
            let dev = self.pg.scalar_device();
            let stop = Tensor::full(
                [1],
                f64::from(u8::from(stop_here)),
                (tch::Kind::Double, dev),
            );
            let flags = Tensor::cat(&[loss.to_device(dev), stop], 0);
            self.pg.all_reduce(&flags, ReduceOp::Sum)?;
            run.window
                .add(flags.narrow(0, 0, 1) / self.pg.world_size() as f64);
            flags.double_value(&[1]) > 0.0
        };
        if run.steps % self.config.log_every == 0 || any_stop {
            if let Some(mean) = run.window.take_mean() {
                run.losses.push((run.steps, mean));
                if self.pg.is_main() {
                    tracing::info!(step = run.steps, epoch, loss = mean, "training");
                }
            }
        }
        Ok(any_stop)
    }

    /// Rank 0 writes; the others build nothing.
    fn checkpoint(
        &self,
        run: &mut Run<'_>,
        vs: &VarStore,
        opt: &Optimizer,
    ) -> Result<(), TrainError> {
        if let (Some(dir), true) = (&run.dir, self.pg.is_main()) {
            run.last_ckpt = save_parts(dir, run.steps, vs, opt, &run.batches, &Values::new())?;
        }
        Ok(())
    }

    /// The last checkpoint, the barrier, the report.
    fn finish(
        &self,
        mut run: Run<'_>,
        vs: &VarStore,
        opt: &Optimizer,
        outcome: FitOutcome,
        epoch: u64,
    ) -> Result<FitReport, TrainError> {
        self.checkpoint(&mut run, vs, opt)?;
        self.pg.barrier()?;
        if outcome == FitOutcome::Preempted && self.pg.is_main() {
            tracing::info!(step = run.steps, "preempted: checkpoint written, stopping");
        }
        Ok(FitReport {
            outcome,
            steps: run.steps,
            epoch,
            resumed_from: run.resumed_from,
            losses: run.losses,
            checkpoint: run.last_ckpt,
        })
    }
}
