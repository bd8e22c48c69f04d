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

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::state::{resume_parts, save_parts, save_parts_async, Values};
use crate::tensorboard::EventWriter;
use crate::{EpochBatches, TrainError};
use crate::{GradScaler, Precision};

/// Held-out evaluation during training (see [`Trainer::fit_eval`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EvalConfig {
    /// Evaluate every this many steps (and after the last step).
    pub every: u64,
    /// The held-out sample indices, split over the ranks (rank `r` takes every
    /// `world_size`-th index from the `r`-th).
    pub indices: std::ops::Range<u64>,
    /// Samples per evaluation batch on each rank.
    pub batch_size: usize,
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
    /// Resume a checkpoint written by another number of processes, continuing its
    /// epoch over this run's ranks (default `false`: refused with
    /// [`TrainError::WorldSizeChanged`], since it changes which samples each rank
    /// sees).
    pub allow_reshard: bool,
    /// Install the process's SIGTERM / SIGINT handlers (default `true`, once per
    /// process: see [`install_signal_handlers`](crate::install_signal_handlers)).
    /// `false` leaves signals to you; [`Trainer::request_stop`] still stops.
    pub handle_signals: bool,
    /// Micro-batches per step (default 1): each rank's batch of `batch_size` is split
    /// into this many parts, the step function runs on each, the gradients accumulate
    /// (synchronised across ranks only after the last part, DDP's `no_sync` before)
    /// and the optimizer steps once. Each part's loss is weighted by its share of the
    /// batch, so the step equals one on the whole batch; the sampler still advances one
    /// batch a step, so a resume stays exact.
    pub accumulate: usize,
    /// Clip the gradients to this global L2 norm before each optimizer step (PyTorch's
    /// `clip_grad_norm_`); under DDP the gradients are already averaged, so every rank
    /// clips by the same norm. The norm before clipping is logged.
    pub clip_grad_norm: Option<f64>,
    /// Seed libtorch's generators at the start of every step from (`seed`, rank, step)
    /// (default `true`): dropout and other random draws in the step function are then
    /// the same in a resumed run as in an uninterrupted one, bit for bit for a fixed
    /// world size, and differ between ranks.
    pub seed_every_step: bool,
    /// A JSON Lines file that rank 0 appends one line to at every log step (step,
    /// epoch, loss, learning rate, gradient norm when clipping, samples per second).
    pub metrics_file: Option<PathBuf>,
    /// Held-out evaluation ([`Trainer::fit_eval`]); with a checkpoint directory, the
    /// checkpoint of the best (lowest) evaluation so far is kept in its `best/`.
    pub eval: Option<EvalConfig>,
    /// Mixed precision: [`Precision::Bf16`] or [`Precision::Fp16`] (default full).
    pub precision: Precision,
    /// A directory for TensorBoard event files (rank 0; `tensorboard --logdir` on it):
    /// `train/loss`, `train/lr`, `train/samples_per_s` and `train/grad_norm` at every
    /// log step, `eval/metric` at every evaluation. A resumed run adds a new file to
    /// the same directory, as PyTorch's `SummaryWriter` does.
    pub tensorboard_dir: Option<PathBuf>,
    /// An SVG picture of the loss (and evaluation) curve, written by rank 0 when
    /// training ends or is preempted. With a [`metrics_file`](Self::metrics_file) the
    /// curve covers the whole history in it (resumes included); otherwise this run's.
    pub loss_curve: Option<PathBuf>,
    /// A progress bar on rank 0 (default `true`): steps done of all, the last loss
    /// and evaluation, speed and time left; drawn only when standard error is a
    /// terminal (never in logs or pipes).
    pub progress: bool,
    /// Micro-batches that [`Trainer::fit_prefetched`] prepares ahead on its loader
    /// thread (default 2).
    pub prefetch: usize,
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
            accumulate: 1,
            clip_grad_norm: None,
            seed_every_step: true,
            metrics_file: None,
            eval: None,
            precision: Precision::Full,
            tensorboard_dir: None,
            loss_curve: None,
            progress: true,
            prefetch: 2,
        }
    }

    /// With TensorBoard event files in this directory (rank 0).
    pub fn tensorboard(mut self, dir: impl Into<PathBuf>) -> TrainConfig {
        self.tensorboard_dir = Some(dir.into());
        self
    }

    /// With an SVG loss curve written to this file at the end (rank 0).
    pub fn loss_curve(mut self, path: impl Into<PathBuf>) -> TrainConfig {
        self.loss_curve = Some(path.into());
        self
    }

    /// With this precision for the forward pass.
    pub fn precision(mut self, precision: Precision) -> TrainConfig {
        self.precision = precision;
        self
    }

    /// Evaluates on the held-out `indices` every `every` steps, in batches of
    /// `batch_size` per rank (see [`Trainer::fit_eval`]).
    pub fn evaluate(
        mut self,
        every: u64,
        indices: std::ops::Range<u64>,
        batch_size: usize,
    ) -> TrainConfig {
        self.eval = Some(EvalConfig {
            every,
            indices,
            batch_size,
        });
        self
    }

    /// With `k` micro-batches per step (gradient accumulation).
    pub fn accumulate(mut self, k: usize) -> TrainConfig {
        self.accumulate = k;
        self
    }

    /// Clipping the gradients to this global norm.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> TrainConfig {
        self.clip_grad_norm = Some(max_norm);
        self
    }

    /// With the metrics appended to this JSON Lines file (rank 0).
    pub fn metrics(mut self, path: impl Into<PathBuf>) -> TrainConfig {
        self.metrics_file = Some(path.into());
        self
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
        if self.accumulate == 0 || self.accumulate > self.batch_size {
            return Err(TrainError::Config(format!(
                "accumulate is {}: give 1 to {} micro-batches (each needs at least one of \
                 the batch's {} samples)",
                self.accumulate, self.batch_size, self.batch_size
            )));
        }
        if let Some(max) = self.clip_grad_norm {
            if !(max.is_finite() && max > 0.0) {
                return Err(TrainError::Config(format!(
                    "clip_grad_norm is {max}: give a norm > 0 (e.g. 1.0), or None"
                )));
            }
        }
        if let Some(eval) = &self.eval {
            if eval.every == 0 || eval.batch_size == 0 || eval.indices.is_empty() {
                return Err(TrainError::Config(format!(
                    "eval: every {} steps, batch {} over {:?}: give every > 0, batch_size > 0 \
                     and a non-empty range of held-out indices",
                    eval.every, eval.batch_size, eval.indices
                )));
            }
        }
        for (what, path) in [
            ("metrics_file", &self.metrics_file),
            ("loss_curve", &self.loss_curve),
        ] {
            if let Some(path) = path {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
                if path.is_dir() || parent.is_some_and(|p| !p.is_dir()) {
                    return Err(TrainError::Config(format!(
                        "{what} {}: give a file in an existing directory",
                        path.display()
                    )));
                }
            }
        }
        if let Some(dir) = &self.tensorboard_dir {
            if dir.exists() && !dir.is_dir() {
                return Err(TrainError::Config(format!(
                    "tensorboard_dir {} is a file: give a directory (created if missing)",
                    dir.display()
                )));
            }
        }
        if self.prefetch == 0 {
            return Err(TrainError::Config(
                "prefetch is 0: give the micro-batches to prepare ahead (e.g. 2)".into(),
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
    /// Which micro-batch of the step this is (0-based; see
    /// [`TrainConfig::accumulate`]).
    pub micro_batch: usize,
    /// How many micro-batches this step has.
    pub micro_batches: usize,
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
    /// `(step, evaluation averaged over every held-out sample)` at each evaluation of
    /// this run.
    pub evals: Vec<(u64, f64)>,
    /// The best (lowest) evaluation, resumes included: `(step, value)`.
    pub best: Option<(u64, f64)>,
    /// Steps whose optimizer update was skipped because the gradients were not finite
    /// ([`Precision::Fp16`]), in this run.
    pub skipped_steps: u64,
    /// The loss scale at the end ([`Precision::Fp16`]; `None` otherwise).
    pub loss_scale: Option<f64>,
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
    /// The step and values of the checkpoint last started in the background: when the
    /// run ends there, that checkpoint is the final one (waited for, not written again).
    background: Option<(u64, Values)>,
    /// The last step's gradient norm before clipping (on the device).
    grad_norm: Option<Tensor>,
    /// The trainable variables (for clipping).
    params: Vec<Tensor>,
    metrics: Option<std::fs::File>,
    /// Samples and time since the last log line.
    since_log: (u64, std::time::Instant),
    evals: Vec<(u64, f64)>,
    best: Option<(u64, f64)>,
    /// Where the best checkpoint goes (`<checkpoint_dir>/best`).
    best_dir: Option<CheckpointDir>,
    /// Fp16's loss scale and good steps since it last changed.
    scaler: Option<GradScaler>,
    skipped: u64,
    /// Rank 0's TensorBoard event file.
    events: Option<EventWriter>,
    /// Rank 0's progress bar (hidden when standard error is not a terminal).
    bar: Option<ProgressBar>,
}

impl Run<'_> {
    /// A log line, with the progress bar out of its way.
    fn say(&self, line: impl FnOnce()) {
        match &self.bar {
            Some(bar) => bar.suspend(line),
            None => line(),
        }
    }

    /// The progress bar's message: the epoch, the last logged loss and evaluation.
    fn show(&self, epoch: u64) {
        if let Some(bar) = &self.bar {
            let mut msg = format!("epoch {epoch}");
            if let Some((_, loss)) = self.losses.last() {
                msg += &format!("  loss {loss:.4}");
            }
            if let Some((_, eval)) = self.evals.last() {
                msg += &format!("  eval {eval:.4}");
            }
            bar.set_message(msg);
        }
    }

    /// Scalars to the TensorBoard file; a failed write is a warning.
    fn scalars(&mut self, scalars: &[(&str, f64)]) {
        if let Some(w) = &mut self.events {
            let scalars: Vec<(&str, f32)> = scalars.iter().map(|&(t, v)| (t, v as f32)).collect();
            if let Err(e) = w.add_scalars(&scalars, self.steps).and_then(|()| w.flush()) {
                tracing::warn!("cannot write the TensorBoard event file: {e}");
            }
        }
    }
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
        step: F,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.check_eval("fit")?;
        self.fit_inner(
            vs,
            opt,
            step,
            None::<fn(&StepContext<'_>) -> Result<Tensor, E>>,
        )
    }

    /// As [`Trainer::fit`], evaluating as [`TrainConfig::eval`] says: every `every`
    /// steps and after the last, `eval` runs (without gradients) on this rank's share
    /// of the held-out indices in batches and returns each batch's mean metric (a
    /// scalar, lower is better, such as the loss); the trainer averages it over every
    /// held-out sample of every rank, logs it, and with a checkpoint directory keeps
    /// the checkpoint of the best evaluation in `<dir>/best` (the best survives resumes).
    pub fn fit_eval<F, G, E>(
        &mut self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        step: F,
        eval: G,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.check_eval("fit_eval")?;
        self.fit_inner(vs, opt, step, Some(eval))
    }

    /// As [`Trainer::fit`], with the batches prepared ahead on a loader thread: `load`
    /// builds a micro-batch's data (tensors, or anything `Send`) from the step context
    /// the step will get (its indices, device, epoch, step), while the current step
    /// runs; `step` then gets the context and that batch. Up to
    /// [`TrainConfig::prefetch`] micro-batches are prepared ahead; the order is the
    /// sampler's, and the checkpointed data position is that of the steps done, not of
    /// the batches prepared, so a resume is as exact as with [`Trainer::fit`].
    ///
    /// `load` runs on another thread, so it must not draw from libtorch's global
    /// random generator (the trainer seeds it for the step, see
    /// [`TrainConfig::seed_every_step`]): derive any random augmentation from the
    /// indices and epoch. An error from `load` ends the training as a step error does;
    /// a panic in it ends it with an error that says so.
    ///
    /// ```no_run
    /// # use tch::{nn::{self, Module}, Kind, Tensor};
    /// # use tt_optim::{Optimizer, SgdConfig};
    /// # use tt_train::{TrainConfig, Trainer};
    /// # let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3))?;
    /// # let mut vs = nn::VarStore::new(trainer.device());
    /// # let net = nn::linear(vs.root(), 8, 1, Default::default());
    /// # let mut opt = Optimizer::sgd(&vs, SgdConfig::default())?;
    /// let features = Tensor::randn([1024, 8], (Kind::Float, tch::Device::Cpu));
    /// let report = trainer.fit_prefetched(
    ///     &mut vs,
    ///     &mut opt,
    ///     // On the loader thread: gather the rows and move them to the device. (A
    ///     // Tensor can move to another thread but not be shared: move it, or a
    ///     // shallow_clone of it, into the loader.)
    ///     move |ctx| {
    ///         let idx: Vec<i64> = ctx.indices.iter().map(|&i| i as i64).collect();
    ///         features.f_index_select(0, &Tensor::from_slice(&idx))?.f_to_device(ctx.device)
    ///     },
    ///     |_ctx, x: Tensor| net.forward(&x).pow_tensor_scalar(2).f_mean(Kind::Float),
    /// )?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fit_prefetched<L, B, F, E>(
        &mut self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        load: L,
        step: F,
    ) -> Result<FitReport, TrainError>
    where
        L: FnMut(&StepContext<'_>) -> Result<B, E> + Send,
        B: Send,
        F: FnMut(&StepContext<'_>, B) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.check_eval("fit_prefetched")?;
        self.prefetched(
            vs,
            opt,
            load,
            step,
            None::<fn(&StepContext<'_>) -> Result<Tensor, E>>,
        )
    }

    /// [`Trainer::fit_prefetched`] with evaluation as in [`Trainer::fit_eval`] (the
    /// evaluation builds its own batches from the context's indices).
    pub fn fit_eval_prefetched<L, B, F, G, E>(
        &mut self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        load: L,
        step: F,
        eval: G,
    ) -> Result<FitReport, TrainError>
    where
        L: FnMut(&StepContext<'_>) -> Result<B, E> + Send,
        B: Send,
        F: FnMut(&StepContext<'_>, B) -> Result<Tensor, E>,
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.check_eval("fit_eval_prefetched")?;
        self.prefetched(vs, opt, load, step, Some(eval))
    }

    /// Whether `method` (`fit`, `fit_eval`, `fit_prefetched`, `fit_eval_prefetched`)
    /// takes an evaluation function exactly when [`TrainConfig::eval`] asks for one.
    fn check_eval(&self, method: &str) -> Result<(), TrainError> {
        let takes_eval = method.starts_with("fit_eval");
        match (self.config.eval.is_some(), takes_eval) {
            (true, false) => Err(TrainError::Config(format!(
                "an evaluation is configured (TrainConfig::eval): train with {}, which takes \
                 the evaluation function",
                method.replacen("fit", "fit_eval", 1)
            ))),
            (false, true) => Err(TrainError::Config(format!(
                "{method} without TrainConfig::eval: say when and on what to evaluate with \
                 TrainConfig::evaluate(every, held_out_indices, batch_size)"
            ))),
            _ => Ok(()),
        }
    }

    /// The loader thread beside [`Trainer::fit_run`]: it walks a copy of the batches
    /// (the run's own position moves only with the steps done) and sends each
    /// micro-batch's data through a channel of `prefetch` places.
    fn prefetched<L, B, F, G, E>(
        &self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        mut load: L,
        mut step: F,
        eval: Option<G>,
    ) -> Result<FitReport, TrainError>
    where
        L: FnMut(&StepContext<'_>) -> Result<B, E> + Send,
        B: Send,
        F: FnMut(&StepContext<'_>, B) -> Result<Tensor, E>,
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        type Boxed = Box<dyn std::error::Error + Send + Sync>;
        struct Loaded<B> {
            step: u64,
            indices: Vec<u64>,
            data: Result<B, Boxed>,
        }
        let run = self.start(vs, opt)?;
        let mut ahead = run.batches.clone();
        let first = run.steps;
        std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Loaded<B>>(self.config.prefetch);
            let loader = std::thread::Builder::new()
                .name("tt-train-loader".into())
                .spawn_scoped(scope, move || {
                    let _guard = tch::no_grad_guard();
                    for step in first.. {
                        let batch = match ahead.next_batch() {
                            Ok(Some(batch)) => batch,
                            Ok(None) => return,
                            Err(e) => {
                                let data = Err(e.into());
                                let _ = tx.send(Loaded {
                                    step,
                                    indices: Vec::new(),
                                    data,
                                });
                                return;
                            }
                        };
                        for ctx in self.micro_contexts(&batch.indices, batch.epoch, step) {
                            let data = load(&ctx).map_err(Into::into);
                            let loaded = Loaded {
                                step,
                                indices: ctx.indices.to_vec(),
                                data,
                            };
                            if tx.send(loaded).is_err() {
                                return; // the training ended
                            }
                        }
                    }
                })
                .map_err(|cause| TrainError::Io {
                    what: "starting the batch-loader thread".into(),
                    cause,
                })?;
            // Owns the receiver: when the run ends, the loader's next send fails and it
            // stops.
            let take = move |ctx: &StepContext<'_>| -> Result<Tensor, Boxed> {
                let loaded = rx.recv().map_err(|_| {
                    "the batch loader stopped without a batch (it panicked: see its message)"
                })?;
                if loaded.step != ctx.step || loaded.indices != ctx.indices {
                    return Err(format!(
                        "the prefetched batch (step {}, indices {:?}) is not the step's \
                         (step {}, indices {:?})",
                        loaded.step, loaded.indices, ctx.step, ctx.indices
                    )
                    .into());
                }
                step(ctx, loaded.data?).map_err(Into::into)
            };
            let report = self.fit_run(vs, opt, run, take, eval);
            match loader.join() {
                Ok(()) => report,
                Err(_) => report.and(Err(TrainError::Step {
                    step: first,
                    cause: "the batch loader panicked (see its message)".into(),
                })),
            }
        })
    }

    fn fit_inner<F, G, E>(
        &self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        step: F,
        eval: Option<G>,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let run = self.start(vs, opt)?;
        self.fit_run(vs, opt, run, step, eval)
    }

    /// The loop over the batches of a started run.
    fn fit_run<F, G, E, E2>(
        &self,
        vs: &mut VarStore,
        opt: &mut Optimizer,
        mut run: Run<'_>,
        mut step: F,
        mut eval: Option<G>,
    ) -> Result<FitReport, TrainError>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E2>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        E2: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut epoch = 0;
        while let Some(batch) = run.batches.next_batch()? {
            epoch = batch.epoch;
            let lr = opt.lr();
            let loss = self.step(&mut run, opt, &batch.indices, batch.epoch, &mut step)?;
            if let Some(bar) = &run.bar {
                bar.inc(1);
            }
            let any_stop = self.agree(&mut run, loss, batch.epoch, lr)?;
            if any_stop {
                return self.finish(run, vs, opt, FitOutcome::Preempted, batch.epoch);
            }
            if let (Some(cfg), Some(eval)) = (&self.config.eval, eval.as_mut()) {
                if run.steps % cfg.every == 0 {
                    self.evaluate(&mut run, vs, opt, batch.epoch, eval)?;
                }
            }
            if self.config.checkpoint_every > 0 && run.steps % self.config.checkpoint_every == 0 {
                self.checkpoint_in_background(&mut run, vs, opt)?;
            }
        }
        if let Some(mean) = run.window.take_mean() {
            run.losses.push((run.steps, mean));
        }
        if let (Some(cfg), Some(eval)) = (&self.config.eval, eval.as_mut()) {
            // Steps that are multiples of `every` were evaluated in the loop.
            if run.steps % cfg.every != 0 {
                self.evaluate(&mut run, vs, opt, epoch, eval)?;
            }
        }
        let epochs = self.config.epochs;
        self.finish(run, vs, opt, FitOutcome::Finished, epochs)
    }

    /// Runs `eval` on this rank's share of the held-out indices, averages over every
    /// held-out sample of every rank, logs, and keeps the best checkpoint.
    fn evaluate<G, E>(
        &self,
        run: &mut Run<'_>,
        vs: &VarStore,
        opt: &Optimizer,
        epoch: u64,
        eval: &mut G,
    ) -> Result<(), TrainError>
    where
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let Some(cfg) = &self.config.eval else {
            return Ok(());
        };
        let steps = run.steps;
        let failed = |cause: Box<dyn std::error::Error + Send + Sync>| TrainError::Step {
            step: steps,
            cause: format!("evaluation: {cause}").into(),
        };
        let (world, rank) = (self.pg.world_size() as u64, self.pg.rank() as u64);
        let start = cfg.indices.start;
        let mine: Vec<u64> = cfg
            .indices
            .clone()
            .filter(|i| (i - start) % world == rank)
            .collect();
        let dev = self.pg.scalar_device();
        let mut sum = Tensor::zeros([1], (tch::Kind::Double, dev));
        {
            let _guard = tch::no_grad_guard();
            for part in mine.chunks(cfg.batch_size) {
                let ctx = StepContext {
                    indices: part,
                    device: self.device,
                    epoch,
                    step: steps,
                    micro_batch: 0,
                    micro_batches: 1,
                };
                let metric = eval(&ctx).map_err(|e| failed(e.into()))?;
                if metric.numel() != 1 {
                    return Err(failed(
                        format!(
                            "the evaluation must return a scalar, not a tensor of shape {:?}",
                            metric.size()
                        )
                        .into(),
                    ));
                }
                let weighted = metric
                    .f_to_kind(tch::Kind::Double)
                    .and_then(|m| m.f_reshape([1]))
                    .and_then(|m| m.f_to_device(dev))
                    .map_err(|e| failed(e.into()))?
                    * part.len() as f64;
                sum += weighted;
            }
        }
        let count = Tensor::full([1], mine.len() as f64, (tch::Kind::Double, dev));
        let both = Tensor::cat(&[sum, count], 0);
        self.pg.all_reduce(&both, ReduceOp::Sum)?;
        let value = both.double_value(&[0]) / both.double_value(&[1]).max(1.0);
        run.evals.push((steps, value));
        // A NaN evaluation (a diverged run) is never the best, even the first one.
        let improved = !value.is_nan() && run.best.is_none_or(|(_, b)| value < b);
        if self.pg.is_main() {
            run.say(|| {
                tracing::info!(step = steps, epoch, eval = value, improved, "evaluation");
            });
            run.show(epoch);
            run.scalars(&[("eval/metric", value)]);
            append_metrics(
                &mut run.metrics,
                &serde_json::json!({"step": steps, "epoch": epoch, "eval": value}),
            );
        }
        if improved {
            run.best = Some((steps, value));
            if let (Some(best_dir), true) = (&run.best_dir, self.pg.is_main()) {
                save_parts(best_dir, steps, vs, opt, &run.batches, &self.values(run))?;
            }
        }
        Ok(())
    }

    /// The trainer's own values in a checkpoint: the best evaluation.
    fn values(&self, run: &Run<'_>) -> Values {
        let mut values = Values::new();
        if let Some(best) = run.best {
            values.insert(BEST.into(), serde_json::json!(best));
        }
        if let Some(scaler) = run.scaler {
            values.insert(SCALER.into(), serde_json::json!(scaler.state()));
        }
        values
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
        let mut values = Values::new();
        let resumed_from = match &dir {
            Some(dir) => resume_parts(dir, vs, opt, &mut batches, reshard, Some(&mut values))?,
            None => None,
        };
        let best: Option<(u64, f64)> = saved(&values, BEST);
        let scaler = (cfg.precision == Precision::Fp16)
            .then(|| saved(&values, SCALER).map_or_else(GradScaler::default, GradScaler::restored));
        let best_dir = match (&cfg.checkpoint_dir, &cfg.eval) {
            (Some(d), Some(_)) => Some(
                CheckpointDir::open(d.join("best"))?
                    .keep_last(1)
                    .writer(pg.is_main()),
            ),
            _ => None,
        };
        let ddp = Ddp::new(pg, vs)?;
        let metrics = match (&cfg.metrics_file, pg.is_main()) {
            (Some(path), true) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|cause| TrainError::Io {
                        what: format!("opening the metrics file {}", path.display()),
                        cause,
                    })?,
            ),
            _ => None,
        };
        let events = match (&cfg.tensorboard_dir, pg.is_main()) {
            (Some(dir), true) => {
                Some(EventWriter::create(dir).map_err(|cause| TrainError::Io {
                    what: "starting the TensorBoard event file".into(),
                    cause,
                })?)
            }
            _ => None,
        };
        let bar = (cfg.progress && pg.is_main()).then(|| {
            let done = resumed_from.unwrap_or(0);
            let bar = ProgressBar::with_draw_target(
                Some(done + batches.remaining_batches()),
                ProgressDrawTarget::stderr(),
            );
            let style = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  {per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_position(done);
            bar
        });
        Ok(Run {
            batches,
            dir,
            ddp,
            steps: resumed_from.unwrap_or(0),
            resumed_from,
            losses: Vec::new(),
            window: LossWindow::default(),
            last_ckpt: None,
            background: None,
            grad_norm: None,
            params: vs.trainable_variables(),
            metrics,
            since_log: (0, std::time::Instant::now()),
            evals: Vec::new(),
            best,
            best_dir,
            scaler,
            skipped: 0,
            events,
            bar,
        })
    }

    /// The contexts of one step's micro-batches (the step's `indices` split as
    /// [`TrainConfig::accumulate`] says), the same for the step and the loader.
    fn micro_contexts<'i>(
        &self,
        indices: &'i [u64],
        epoch: u64,
        step: u64,
    ) -> Vec<StepContext<'i>> {
        let parts = micro_batches(indices, self.config.accumulate);
        let micro_batches = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(micro_batch, part)| StepContext {
                indices: part,
                device: self.device,
                epoch,
                step,
                micro_batch,
                micro_batches,
            })
            .collect()
    }

    /// One step: the user's loss on each micro-batch, DDP's backward, clipping, the
    /// optimizer. Returns the loss (the batch's, micro-batches weighted by size), as a
    /// one-element double tensor still on its device: nothing here waits for the GPU.
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
        let steps = run.steps;
        let failed = |cause: Box<dyn std::error::Error + Send + Sync>| TrainError::Step {
            step: steps,
            cause,
        };
        if self.config.seed_every_step {
            tch::manual_seed(step_seed(self.config.seed, self.pg.rank() as u64, steps));
        }
        opt.zero_grad();
        let mut value: Option<Tensor> = None;
        for ctx in self.micro_contexts(indices, epoch, steps) {
            let (m, parts) = (ctx.micro_batch, ctx.micro_batches);
            let loss = match self.config.precision.autocast_kind() {
                None => step(&ctx),
                Some(kind) => tt_sys::autocast(self.device, kind, || step(&ctx))
                    .map_err(|e| failed(e.into()))?,
            }
            .map_err(|e| failed(e.into()))?;
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
            // Each part's mean loss weighted by its share: the batch's mean loss.
            let loss = if parts == 1 {
                loss
            } else {
                loss * (ctx.indices.len() as f64 / indices.len() as f64)
            };
            let detached = loss
                .detach()
                .f_to_kind(tch::Kind::Double)
                .and_then(|l| l.f_reshape([1]))
                .map_err(|e| failed(e.into()))?;
            value = Some(match value.take() {
                Some(v) => v + detached,
                None => detached,
            });
            let loss = match &run.scaler {
                Some(scaler) => scaler.scale_loss(&loss).map_err(|e| failed(e.into()))?,
                None => loss,
            };
            if m + 1 < parts {
                run.ddp.no_sync(|| run.ddp.backward(&loss))?;
            } else {
                run.ddp.backward(&loss)?;
            }
        }
        let finite = match &run.scaler {
            Some(scaler) => scaler.unscale(&run.params).map_err(|e| failed(e.into()))?,
            None => true,
        };
        if let Some(max_norm) = self.config.clip_grad_norm {
            run.grad_norm =
                Some(clip_grad_norm(&run.params, max_norm).map_err(|e| failed(e.into()))?);
        }
        // torch.amp.GradScaler: a step with gradients that are not all finite is
        // skipped and the scale backed off.
        let take = run.scaler.as_mut().is_none_or(|s| s.update(finite));
        if take {
            opt.step()?;
        } else {
            run.skipped += 1;
            tracing::info!(
                step = steps,
                scale = run.scaler.map_or(1.0, |s| s.scale()),
                "gradients not finite: step skipped"
            );
        }
        run.steps += 1;
        run.since_log.0 += indices.len() as u64;
        value.ok_or_else(|| failed("an empty batch".into()))
    }

    /// One small all-reduce a step: the loss summed over the ranks (for the log) and
    /// whether any rank was signalled, so that all stop after the same step. Logs
    /// every `log_every` steps; returns whether to stop.
    ///
    /// One process alone reads nothing from the device; several read the reduced stop
    /// flag, the step's one host sync (all ranks must agree on when to stop).
    fn agree(
        &self,
        run: &mut Run<'_>,
        loss: Tensor,
        epoch: u64,
        lr: f64,
    ) -> Result<bool, TrainError> {
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
                    self.log(run, epoch, mean, lr);
                }
            }
        }
        Ok(any_stop)
    }

    /// Rank 0's log line and metrics record.
    fn log(&self, run: &mut Run<'_>, epoch: u64, loss: f64, lr: f64) {
        let grad_norm = run.grad_norm.as_ref().map(|n| n.double_value(&[]));
        let (samples, since) =
            std::mem::replace(&mut run.since_log, (0, std::time::Instant::now()));
        // Samples of all ranks per second.
        let throughput = (samples * self.pg.world_size() as u64) as f64
            / since.elapsed().as_secs_f64().max(1e-9);
        run.say(|| {
            tracing::info!(
                step = run.steps,
                epoch,
                loss,
                lr,
                grad_norm,
                throughput,
                "training"
            );
        });
        run.show(epoch);
        let mut scalars = vec![
            ("train/loss", loss),
            ("train/lr", lr),
            ("train/samples_per_s", throughput),
        ];
        scalars.extend(grad_norm.map(|n| ("train/grad_norm", n)));
        run.scalars(&scalars);
        if run.metrics.is_some() {
            let mut record = serde_json::json!({
                "step": run.steps,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "samples_per_s": throughput,
            });
            if let Some(n) = grad_norm {
                record["grad_norm"] = serde_json::json!(n);
            }
            append_metrics(&mut run.metrics, &record);
        }
    }

    /// The SVG loss curve: the metrics file's history if there is one, else this
    /// run's; a failed write is a warning (the training is done).
    fn write_curve(&self, run: &Run<'_>, path: &std::path::Path) {
        let history = self
            .config
            .metrics_file
            .as_deref()
            .and_then(|m| crate::curve::read_metrics(m).ok());
        let (losses, evals) = history.unwrap_or_else(|| (run.losses.clone(), run.evals.clone()));
        let svg = crate::loss_curve_svg(&losses, &evals);
        if let Err(e) =
            tt_ckpt::atomic_write(path, |w| std::io::Write::write_all(w, svg.as_bytes()))
        {
            tracing::warn!("cannot write the loss curve {}: {e}", path.display());
        }
    }

    /// A periodic checkpoint, written while training goes on (rank 0; CUDA state is
    /// copied on the stream without stopping the loop): the next save, the final one
    /// included, finishes it first.
    fn checkpoint_in_background(
        &self,
        run: &mut Run<'_>,
        vs: &VarStore,
        opt: &Optimizer,
    ) -> Result<(), TrainError> {
        if let (Some(dir), true) = (&run.dir, self.pg.is_main()) {
            let values = self.values(run);
            save_parts_async(dir, run.steps, vs, opt, &run.batches, &values)?;
            run.background = Some((run.steps, values));
        }
        Ok(())
    }

    /// Rank 0 writes; the others build nothing.
    fn checkpoint(
        &self,
        run: &mut Run<'_>,
        vs: &VarStore,
        opt: &Optimizer,
    ) -> Result<(), TrainError> {
        if let (Some(dir), true) = (&run.dir, self.pg.is_main()) {
            let values = self.values(run);
            run.last_ckpt = match run.background.take() {
                // The run ended at the background checkpoint's step, nothing changed
                // since: it is the final checkpoint once durable (not written twice).
                Some((step, saved)) if step == run.steps && saved == values => match dir.wait()? {
                    Some(path) => Some(path),
                    None => save_parts(dir, run.steps, vs, opt, &run.batches, &values)?,
                },
                _ => save_parts(dir, run.steps, vs, opt, &run.batches, &values)?,
            };
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
        if let Some(bar) = run.bar.take() {
            match outcome {
                FitOutcome::Finished => bar.finish(),
                FitOutcome::Preempted => bar.abandon_with_message("preempted"),
            }
        }
        if outcome == FitOutcome::Preempted && self.pg.is_main() {
            tracing::info!(step = run.steps, "preempted: checkpoint written, stopping");
        }
        if let (Some(path), true) = (&self.config.loss_curve, self.pg.is_main()) {
            self.write_curve(&run, path);
        }
        Ok(FitReport {
            outcome,
            steps: run.steps,
            epoch,
            resumed_from: run.resumed_from,
            losses: run.losses,
            checkpoint: run.last_ckpt,
            evals: run.evals,
            best: run.best,
            skipped_steps: run.skipped,
            loss_scale: run.scaler.map(|s| s.scale()),
        })
    }
}

/// The best evaluation `(step, value)` in a checkpoint's values.
const BEST: &str = "tt_train.best_eval";
/// Fp16's `(loss scale, good steps since it changed)` in a checkpoint's values.
const SCALER: &str = "tt_train.grad_scaler";

/// The trainer's value `key` in a checkpoint's values, if there and readable.
fn saved<T: serde::de::DeserializeOwned>(values: &Values, key: &str) -> Option<T> {
    values
        .get(key)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

/// One line of the metrics file, if there is one; a failed write is a warning (the
/// training goes on).
fn append_metrics(file: &mut Option<std::fs::File>, record: &serde_json::Value) {
    use std::io::Write;
    if let Some(file) = file {
        if let Err(e) = writeln!(file, "{record}") {
            tracing::warn!("cannot append to the metrics file: {e}");
        }
    }
}

/// `indices` split into `k` contiguous parts (at most one per sample), sizes differing
/// by at most one.
fn micro_batches(indices: &[u64], k: usize) -> Vec<&[u64]> {
    let k = k.clamp(1, indices.len().max(1));
    let (base, extra) = (indices.len() / k, indices.len() % k);
    let mut parts = Vec::with_capacity(k);
    let mut start = 0;
    for i in 0..k {
        let len = base + usize::from(i < extra);
        parts.push(&indices[start..start + len]);
        start += len;
    }
    parts
}

/// A seed for (`seed`, rank, step): splitmix64 of the three, so that neighbouring steps
/// and ranks get unrelated streams.
fn step_seed(seed: u64, rank: u64, step: u64) -> i64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(rank.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(step.wrapping_mul(0x94D0_49BB_1331_11EB));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 1) as i64
}

/// PyTorch's `clip_grad_norm_`: scales every gradient by `max_norm / (norm + 1e-6)`
/// when that is below 1; returns the norm before clipping (on the device, no sync).
fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor, tch::TchError> {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params
        .iter()
        .map(Tensor::grad)
        .filter(Tensor::defined)
        .collect();
    if grads.is_empty() {
        return Tensor::f_zeros([], (tch::Kind::Double, tch::Device::Cpu));
    }
    let norms = grads
        .iter()
        .map(|g| g.f_norm().and_then(|n| n.f_to_kind(tch::Kind::Double)))
        .collect::<Result<Vec<_>, _>>()?;
    let total = Tensor::f_stack(&norms, 0)?.f_norm()?;
    // A 0-dim tensor on the gradients' device: each in-place product keeps the
    // gradient's dtype.
    let coef = (max_norm / (&total + 1e-6)).f_clamp_max(1.0)?;
    for g in &grads {
        let _ = g.shallow_clone().f_mul_(&coef)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::{micro_batches, step_seed};

    #[test]
    fn micro_batches_cover_the_batch_in_order_with_sizes_differing_by_one() {
        let idx: Vec<u64> = (10..17).collect();
        let parts = micro_batches(&idx, 3);
        assert_eq!(parts, vec![&idx[0..3], &idx[3..5], &idx[5..7]]);
        assert_eq!(micro_batches(&idx, 1), vec![&idx[..]]);
        assert_eq!(
            micro_batches(&idx[..2], 5).len(),
            2,
            "at most one part per sample"
        );
    }

    #[test]
    fn step_seeds_differ_by_step_rank_and_seed() {
        let a = step_seed(7, 0, 3);
        assert_eq!(a, step_seed(7, 0, 3));
        assert!(a >= 0);
        assert_ne!(a, step_seed(7, 0, 4));
        assert_ne!(a, step_seed(7, 1, 3));
        assert_ne!(a, step_seed(8, 0, 3));
    }
}
