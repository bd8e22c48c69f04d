//! The unified trainer: one training loop for one process or many (torchhandy's
//! `Parallel_Trainer`, with what it lacks: multi-node, resumable sampling, optimizer
//! state in checkpoints, barriers, preemption).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::nn::VarStore;
use tch::{Device, Tensor};
use tt_dist::{ProcessGroup, ReduceOp};
use tt_optim::Optimizer;

use crate::run::Run;
use crate::sinks::LogRecord;
use crate::work::{BoxError, Eval, Feed, Optimizers, StepContext};
use crate::{FitOutcome, FitReport};
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
    pub(crate) pg: Arc<ProcessGroup>,
    pub(crate) device: Device,
    pub(crate) config: TrainConfig,
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
            crate::install_signal_handlers().map_err(TrainError::Signal)?
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
        let report = (|| {
            let mut run = self.start(vs, opt, eval.is_some(), &mut user)?;
            match feed {
                Feed::Direct(mut step) => {
                    crate::micro::ensure(self, &mut run, opt, &mut *step)?;
                    self.fit_run(vs, opt, run, &mut *step, eval.as_mut())
                }
                Feed::Prefetched { load, step } => {
                    crate::prefetch::fit(self, vs, opt, run, load, step, eval.as_mut())
                }
            }
        })();
        self.loggers = user;
        report
    }

    /// The loop over the batches of a started run.
    pub(crate) fn fit_run(
        &self,
        vs: &mut VarStore,
        opt: &mut [Optimizer],
        mut run: Run<'_>,
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
        mut eval: Option<&mut Eval<'_>>,
    ) -> Result<FitReport, TrainError> {
        let mut epoch = 0;
        while let Some(batch) = run.batches.next_batch()? {
            epoch = batch.epoch;
            // The first optimizer's rate is the one logged.
            let lr = opt.first().map_or(0.0, Optimizer::lr);
            let loss = self.step(&mut run, opt, &batch.indices, batch.epoch, step)?;
            run.sinks.step(run.steps);
            if self.agree(&mut run, loss, batch.epoch, lr)? {
                return self.finish(run, vs, opt, FitOutcome::Preempted, batch.epoch);
            }
            if let Some(eval) = eval.as_deref_mut() {
                if run.steps % eval.every == 0 {
                    crate::eval::evaluate(self, &mut run, vs, opt, batch.epoch, eval)?;
                }
            }
            if self.config.checkpoint_every > 0 && run.steps % self.config.checkpoint_every == 0 {
                self.checkpoint_in_background(&mut run, vs, opt)?;
            } else if self.pg.is_main() {
                self.settle(&mut run, false)?;
            }
        }
        if let Some(mean) = run.window.take_mean() {
            run.losses.push((run.steps, mean));
        }
        if let Some(eval) = eval {
            // Steps that are multiples of `every` were evaluated in the loop.
            if run.steps % eval.every != 0 {
                crate::eval::evaluate(self, &mut run, vs, opt, epoch, eval)?;
            }
        }
        let epochs = self.config.epochs;
        self.finish(run, vs, opt, FitOutcome::Finished, epochs)
    }

    /// The contexts of one step's micro-batches, the same for the step and the loader:
    /// the step's `indices` split into [`TrainConfig::accumulate`] parts, or, once the
    /// adaptive micro-batch is known, into parts of at most `micro` samples.
    pub(crate) fn micro_contexts<'i>(
        (accumulate, micro): (usize, Option<usize>),
        device: Device,
        indices: &'i [u64],
        epoch: u64,
        step: u64,
    ) -> Vec<StepContext<'i>> {
        let k = micro.map_or(accumulate, |m| indices.len().div_ceil(m));
        let parts = crate::micro_batches(indices, k);
        let micro_batches = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(micro_batch, part)| StepContext {
                indices: part,
                device,
                epoch,
                step,
                micro_batch,
                micro_batches,
            })
            .collect()
    }

    /// One step: the user's loss on each micro-batch with its backward, then the
    /// scaler, clipping and the optimizer. Returns the loss (the batch's, micro-batches
    /// weighted by size), as a one-element double tensor still on its device: nothing
    /// here waits for the GPU.
    fn step(
        &self,
        run: &mut Run<'_>,
        opt: &mut [Optimizer],
        indices: &[u64],
        epoch: u64,
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
    ) -> Result<Tensor, TrainError> {
        let steps = run.steps;
        let failed = |cause: BoxError| TrainError::Step { step: steps, cause };
        if self.config.seed_every_step {
            tch::manual_seed(crate::step_seed(
                self.config.seed,
                self.pg.rank() as u64,
                steps,
            ));
        }
        opt.iter_mut().for_each(Optimizer::zero_grad);
        let mut value: Option<Tensor> = None;
        let split = (self.config.accumulate, run.micro);
        for ctx in Trainer::micro_contexts(split, self.device, indices, epoch, steps) {
            let share = ctx.indices.len() as f64 / indices.len() as f64;
            let sync = ctx.micro_batch + 1 == ctx.micro_batches;
            let detached = self
                .micro_step(run, &ctx, share, sync, step)
                .map_err(failed)?;
            value = Some(match value.take() {
                Some(v) => v + detached,
                None => detached,
            });
        }
        let finite = match &run.scaler {
            Some(scaler) => scaler.unscale(&run.params).map_err(|e| failed(e.into()))?,
            None => true,
        };
        if let Some(max_norm) = self.config.clip_grad_norm {
            let norm = crate::clip_grad_norm(&run.params, max_norm);
            run.grad_norm = Some(norm.map_err(|e| failed(e.into()))?);
        }
        // torch.amp.GradScaler: a step with gradients that are not all finite is
        // skipped and the scale backed off.
        if run.scaler.as_mut().is_none_or(|s| s.update(finite)) {
            for o in opt.iter_mut() {
                o.step()?;
            }
        } else {
            run.skipped += 1;
            let scale = run.scaler.map_or(1.0, |s| s.scale());
            tracing::info!(step = steps, scale, "gradients not finite: step skipped");
        }
        run.steps += 1;
        run.since_log.0 += indices.len() as u64;
        value.ok_or_else(|| failed("an empty batch".into()))
    }

    /// One micro-batch: the user's loss (under autocast), weighted by its `share` of the
    /// batch, scaled for fp16, and its backward (gradients synchronised across the ranks
    /// when `sync`: after the step's last micro-batch). Returns the weighted loss,
    /// detached.
    pub(crate) fn micro_step(
        &self,
        run: &mut Run<'_>,
        ctx: &StepContext<'_>,
        share: f64,
        sync: bool,
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
    ) -> Result<Tensor, BoxError> {
        let loss = match self.config.precision.autocast_kind() {
            None => step(ctx)?,
            Some(kind) => tt_sys::autocast(self.device, kind, || step(ctx))??,
        };
        if loss.numel() != 1 {
            return Err(format!(
                "the loss must be a scalar tensor, not one of shape {:?}: reduce it (e.g. \
                 with .mean())",
                loss.size()
            )
            .into());
        }
        // Each part's mean loss weighted by its share: the batch's mean loss.
        let loss = if ctx.micro_batches == 1 {
            loss
        } else {
            loss * share
        };
        let detached = loss
            .detach()
            .f_to_kind(tch::Kind::Double)
            .and_then(|l| l.f_reshape([1]))?;
        let loss = match &run.scaler {
            Some(scaler) => scaler.scale_loss(&loss)?,
            None => loss,
        };
        if sync {
            run.ddp.backward(&loss)?;
        } else {
            run.ddp.no_sync(|| run.ddp.backward(&loss))?;
        }
        Ok(detached)
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
            let flag = f64::from(u8::from(stop_here));
            let stop = Tensor::full([1], flag, (tch::Kind::Double, dev));
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

    /// Rank 0's log record, to every logger.
    fn log(&self, run: &mut Run<'_>, epoch: u64, loss: f64, lr: f64) {
        let grad_norm = run.grad_norm.as_ref().map(|n| n.double_value(&[]));
        let (samples, since) =
            std::mem::replace(&mut run.since_log, (0, std::time::Instant::now()));
        // Samples of all ranks per second.
        let samples_per_s = (samples * self.pg.world_size() as u64) as f64
            / since.elapsed().as_secs_f64().max(1e-9);
        run.sinks.log(&LogRecord {
            step: run.steps,
            epoch,
            loss,
            lr,
            grad_norm,
            samples_per_s,
            micro_batch: run.micro,
        });
    }

    /// The last checkpoint, the barrier, the report (to the loggers too).
    fn finish(
        &self,
        mut run: Run<'_>,
        vs: &VarStore,
        opt: &[Optimizer],
        outcome: FitOutcome,
        epoch: u64,
    ) -> Result<FitReport, TrainError> {
        self.checkpoint(&mut run, vs, opt)?;
        self.pg.barrier()?;
        let report = FitReport {
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
            micro_batch: run.micro,
        };
        run.sinks.finish(&report);
        Ok(report)
    }
}
