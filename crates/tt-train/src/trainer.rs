//! The unified trainer: one training loop for one process or many (torchhandy's
//! `Parallel_Trainer`, with what it lacks: multi-node, resumable sampling, optimizer
//! state in checkpoints, barriers, preemption).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::nn::VarStore;
use tch::Device;
use tt_dist::ProcessGroup;

use crate::run::{Run, Setup};
use crate::work::{Feed, Optimizers};
use crate::FitReport;
use crate::{Logger, Steps, TrainConfig, TrainError};

/// One training loop for one process or many.
///
/// Started plainly (`cargo run`), it is a group of one on this process's device;
/// started by `torchtools launch --nproc-per-node N` or `torchrun --no-python`, every
/// process is a rank of a c10d group (Gloo on CPU, NCCL on CUDA), on the GPU of its
/// `LOCAL_RANK`. The same code runs in both. [`Trainer::fit`]:
///
/// - shards the dataset with torch's `DistributedSampler` order (tt-sampler);
/// - keeps the model replicas identical ([`Ddp`](tt_dist::Ddp): rank-0 broadcast, averaged gradients);
/// - resumes from the newest valid checkpoint in [`TrainConfig::checkpoints`]:
///   parameters, optimizer state (tt-optim) and sampler position, so the resumed run
///   ends with the parameters of an uninterrupted one;
/// - averages the loss over the ranks for logging (rank 0 logs through `tracing`);
/// - checkpoints on rank 0 only, then meets at a barrier;
/// - on SIGTERM / SIGINT / SIGUSR1 (a scheduler cycling jobs, Slurm's warning) finishes the step, agrees with
///   every rank to stop at the same one, checkpoints and returns
///   [`FitOutcome::Preempted`](crate::FitOutcome::Preempted); a second signal exits at once (status 128 + signal).
///   The handlers are installed once per process by [`Trainer::from_env`] and
///   [`Trainer::with_group`] unless [`TrainConfig::handle_signals`] is `false`.
///
/// # Example
///
/// ```no_run
/// use tch::nn::{self, Module};
/// use tch::{Kind, Tensor};
/// use tt_optim::{Optimizer, SgdConfig};
/// use tt_train::{Steps, TrainConfig, Trainer};
///
/// let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3).checkpoints("ckpt", 100))?;
/// let mut vs = nn::VarStore::new(trainer.device());
/// let net = nn::linear(vs.root(), 8, 1, Default::default());
/// let mut opt = Optimizer::sgd(&vs, SgdConfig { lr: 0.1, ..Default::default() })?;
/// let report = trainer.fit(&mut vs, &mut opt, Steps::new(|ctx| {
///     let idx = Tensor::from_slice(&ctx.indices.iter().map(|&i| i as f32).collect::<Vec<_>>());
///     let x = (idx.unsqueeze(1) * Tensor::ones([1, 8], (Kind::Float, ctx.device))).sin();
///     net.forward(&x).pow_tensor_scalar(2).f_mean(Kind::Float)
/// }))?;
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
    loggers: Vec<Box<dyn Logger + Send>>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("device", &self.device)
            .field("loggers", &self.loggers.len())
            .finish()
    }
}

impl Trainer {
    /// The group from the environment ([`ProcessGroup::from_env`]), the device from
    /// tt-device (`TORCHTOOLS_DEVICE`, `LOCAL_RANK`), the signal handlers (once per
    /// process, unless [`TrainConfig::handle_signals`] is `false`) and the allocator's
    /// setting ([`keep_freed_memory`](crate::keep_freed_memory), unless
    /// [`TrainConfig::keep_freed_memory`] is `false`).
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
            crate::install_signal_handlers().map_err(|cause| TrainError::Signal { cause })?
        } else {
            Arc::new(AtomicBool::new(false))
        };
        // A run that expects out-of-memory errors keeps glibc's defaults: memory kept on
        // the heap cannot serve a large block, which the default would have mapped.
        if config.keep_freed_memory && !config.adaptive_micro_batch {
            let done = crate::keep_freed_memory();
            tracing::debug!(?done, "a step's freed memory kept for the next step");
        }
        Ok(Trainer {
            pg: Arc::new(pg),
            device,
            config,
            stop,
            loggers: Vec::new(),
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

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Whether this is rank 0 (which logs and checkpoints).
    pub fn is_main(&self) -> bool {
        self.pg.is_main()
    }

    /// Asks the loop to stop after the current step, as SIGTERM does.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Adds a [`Logger`] of your own, called on rank 0 after the trainer's (for every
    /// later [`fit`](Trainer::fit)).
    pub fn add_logger(&mut self, logger: impl Logger + Send + 'static) {
        self.loggers.push(Box::new(logger));
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

    /// Trains `vs` with its optimizers (`&mut opt`, or one per parameter group: see
    /// [`Optimizers`]) on the `work` ([`Steps`]: the step function, its loader if the
    /// batches are prepared ahead, the evaluation if any). See [`Trainer`] for what
    /// happens around it.
    pub fn fit<'o>(
        &mut self,
        vs: &mut VarStore,
        optimizers: impl Into<Optimizers<'o>>,
        work: Steps<'_>,
    ) -> Result<FitReport, TrainError> {
        let optimizers = optimizers.into();
        optimizers.validate()?;
        let opt = optimizers.0;
        let Steps { feed, mut eval } = work;
        if let Some(eval) = &eval {
            eval.validate()?;
        }
        let mut user = std::mem::take(&mut self.loggers);
        let setup = Setup {
            config: &self.config,
            pg: &self.pg,
            device: self.device,
            stop: &self.stop,
        };
        let report = (|| {
            let mut run = Run::start(setup, vs, opt, eval.is_some(), &mut user)?;
            match feed {
                Feed::Direct(mut step) => {
                    run.ensure_micro_batch(opt, &mut *step)?;
                    run.train(vs, opt, &mut *step, eval.as_mut())
                }
                Feed::Prefetched { load, step } => {
                    crate::prefetch::fit(run, vs, opt, load, step, eval.as_mut())
                }
            }
        })();
        self.loggers = user;
        report
    }
}
