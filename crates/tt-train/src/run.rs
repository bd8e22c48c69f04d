//! A started run of [`Trainer::fit`](crate::Trainer::fit): what it carries between
//! steps, and how it starts (the sampler, the resume, DDP, the loggers), and its
//! checkpoints. The run is the context every part of the loop below `Trainer` works on
//! (`step.rs`, `micro.rs`, `eval.rs`, `fit.rs`, `prefetch.rs`): it borrows what it reads
//! of the trainer ([`Setup`]), so nothing below calls back up.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use tch::nn::VarStore;
use tch::{Device, Tensor};
use tt_ckpt::CheckpointDir;
use tt_dist::{Ddp, ProcessGroup};
use tt_optim::Optimizer;
use tt_sampler::{DistributedSampler, Reshard};

use crate::sinks::{Console, JsonLines, LossCurve, RunStart, Sinks, TensorBoard};
use crate::state::{
    resume_parts, save_parts, save_parts_async, saved, Values, BEST, MICRO, SCALER,
};
use crate::{EpochBatches, GradScaler, Logger, Precision, TrainConfig, TrainError};

/// What a run reads of its trainer: the configuration, the group, the device and the
/// stop flag its signal handlers set.
#[derive(Clone, Copy)]
pub(crate) struct Setup<'a> {
    pub(crate) config: &'a TrainConfig,
    pub(crate) pg: &'a ProcessGroup,
    pub(crate) device: Device,
    pub(crate) stop: &'a AtomicBool,
}

/// The running loss: summed over the ranks and steps since the last log line, kept on
/// the loss's device (reading it is a host sync on a GPU: done only at log steps).
#[derive(Default)]
pub(crate) struct LossWindow {
    sum: Option<Tensor>,
    steps: u64,
}

impl LossWindow {
    /// Adds one step's loss (a one-element double tensor).
    pub(crate) fn add(&mut self, loss: Tensor) {
        self.sum = Some(match self.sum.take() {
            Some(sum) => sum + loss,
            None => loss,
        });
        self.steps += 1;
    }

    pub(crate) fn take_mean(&mut self) -> Option<f64> {
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

/// A checkpoint written in the background (see [`Run::background`]).
pub(crate) struct Background {
    pub(crate) step: u64,
    pub(crate) values: Values,
    pub(crate) durable: Option<PathBuf>,
}

/// What one [`Trainer::fit`](crate::Trainer::fit) carries between steps.
pub(crate) struct Run<'a> {
    pub(crate) config: &'a TrainConfig,
    pub(crate) pg: &'a ProcessGroup,
    pub(crate) device: Device,
    pub(crate) stop: &'a AtomicBool,
    pub(crate) batches: EpochBatches,
    pub(crate) dir: Option<CheckpointDir>,
    pub(crate) ddp: Ddp<'a>,
    pub(crate) steps: u64,
    pub(crate) resumed_from: Option<u64>,
    pub(crate) losses: Vec<(u64, f64)>,
    pub(crate) window: LossWindow,
    pub(crate) last_ckpt: Option<PathBuf>,
    /// The checkpoint last started in the background: its step, its values and, once
    /// durable (and reported to the loggers), its path. When the run ends at its step,
    /// it is the final checkpoint (waited for, not written again).
    pub(crate) background: Option<Background>,
    /// The last step's gradient norm before clipping (on the device).
    pub(crate) grad_norm: Option<Tensor>,
    /// The trainable variables (for clipping).
    pub(crate) params: Vec<Tensor>,
    /// Samples and time since the last log line.
    pub(crate) since_log: (u64, std::time::Instant),
    pub(crate) evals: Vec<(u64, f64)>,
    pub(crate) best: Option<(u64, f64)>,
    /// Where the best checkpoint goes (`<checkpoint_dir>/best`).
    pub(crate) best_dir: Option<CheckpointDir>,
    /// Fp16's loss scale and good steps since it last changed.
    pub(crate) scaler: Option<GradScaler>,
    pub(crate) skipped: u64,
    /// The micro-batch's samples, when the adaptive search found it (or the checkpoint
    /// had it): each step then has `ceil(batch / micro)` micro-batches.
    pub(crate) micro: Option<usize>,
    /// Rank 0's loggers (none elsewhere).
    pub(crate) sinks: Sinks<'a>,
}

impl<'a> Run<'a> {
    /// The trainer's own values in a checkpoint: the best evaluation, the scaler.
    pub(crate) fn values(&self) -> Values {
        let mut values = Values::new();
        if let Some(best) = self.best {
            values.insert(BEST.into(), serde_json::json!(best));
        }
        if let Some(scaler) = self.scaler {
            values.insert(SCALER.into(), serde_json::json!(scaler.state()));
        }
        if let Some(micro) = self.micro {
            values.insert(MICRO.into(), serde_json::json!(micro));
        }
        values
    }

    /// Rank 0's loggers as the configuration asks (their files opened before any step).
    fn own_loggers(cfg: &TrainConfig) -> Result<Vec<Box<dyn Logger + Send>>, TrainError> {
        let io = |what: String| move |cause| TrainError::Io { what, cause };
        let mut own: Vec<Box<dyn Logger + Send>> = Vec::new();
        if cfg.console {
            own.push(Box::new(Console::new(cfg.progress)));
        }
        if let Some(path) = &cfg.metrics_file {
            let what = format!("opening the metrics file {}", path.display());
            own.push(Box::new(JsonLines::append(path).map_err(io(what))?));
        }
        if let Some(dir) = &cfg.tensorboard_dir {
            let what = "starting the TensorBoard event file".to_owned();
            own.push(Box::new(TensorBoard::create(dir).map_err(io(what))?));
        }
        if let Some(path) = &cfg.loss_curve {
            own.push(Box::new(LossCurve::new(path, cfg.metrics_file.clone())));
        }
        Ok(own)
    }

    /// The sampler, the checkpoint directory, the resume, the DDP wrapper, the loggers.
    pub(crate) fn start(
        setup: Setup<'a>,
        vs: &mut VarStore,
        opt: &mut [Optimizer],
        evaluates: bool,
        user: &'a mut Vec<Box<dyn Logger + Send>>,
    ) -> Result<Run<'a>, TrainError> {
        let (cfg, pg) = (setup.config, setup.pg);
        let sampler =
            DistributedSampler::new(cfg.dataset_len, pg.world_size() as u64, pg.rank() as u64)?
                .with_shuffle(cfg.shuffle)
                .with_seed(cfg.seed);
        let mut batches = EpochBatches::new(sampler, cfg.batch_size, cfg.epochs)?;
        let open = |d: PathBuf, keep: usize| -> Result<CheckpointDir, TrainError> {
            Ok(CheckpointDir::open(d)?.keep_last(keep).writer(pg.is_main()))
        };
        let dir = cfg
            .checkpoint_dir
            .clone()
            .map(|d| open(d, cfg.keep_last))
            .transpose()?;
        let best_dir = match (&cfg.checkpoint_dir, evaluates) {
            (Some(d), true) => Some(open(d.join("best"), 1)?),
            _ => None,
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
        let scaler = (cfg.precision == Precision::Fp16)
            .then(|| saved(&values, SCALER).map_or_else(GradScaler::default, GradScaler::restored));
        let ddp = Ddp::new(pg, vs)?;
        let mut sinks = match pg.is_main() {
            true => Sinks::new(Run::own_loggers(cfg)?, user),
            false => Sinks::default(),
        };
        let done = resumed_from.unwrap_or(0);
        sinks.start(&RunStart {
            step: done,
            total_steps: done + batches.remaining_batches(),
            world_size: pg.world_size(),
        });
        Ok(Run {
            config: cfg,
            pg,
            device: setup.device,
            stop: setup.stop,
            batches,
            dir,
            ddp,
            steps: done,
            resumed_from,
            losses: Vec::new(),
            window: LossWindow::default(),
            last_ckpt: None,
            background: None,
            grad_norm: None,
            params: vs.trainable_variables(),
            since_log: (0, std::time::Instant::now()),
            evals: Vec::new(),
            best: saved(&values, BEST),
            best_dir,
            scaler,
            skipped: 0,
            micro: cfg
                .adaptive_micro_batch
                .then(|| saved::<usize>(&values, MICRO))
                .flatten()
                .filter(|&m| m > 0),
            sinks,
        })
    }

    /// A periodic checkpoint, written while training goes on (rank 0; CUDA state is
    /// copied on the stream without stopping the loop): the next save, the final one
    /// included, finishes it first.
    pub(crate) fn checkpoint_in_background(
        &mut self,
        vs: &VarStore,
        opt: &[Optimizer],
    ) -> Result<(), TrainError> {
        if !self.pg.is_main() {
            return Ok(());
        }
        self.settle(true)?;
        if let Some(dir) = &self.dir {
            let values = self.values();
            save_parts_async(dir, self.steps, vs, opt, &self.batches, &values)?;
            self.background = Some(Background {
                step: self.steps,
                values,
                durable: None,
            });
        }
        Ok(())
    }

    /// The background checkpoint, once durable (waited for with `wait`, else only if
    /// done), reported to the loggers once and its path kept.
    pub(crate) fn settle(&mut self, wait: bool) -> Result<(), TrainError> {
        let (Some(dir), Some(bg)) = (&self.dir, &mut self.background) else {
            return Ok(());
        };
        if bg.durable.is_none() {
            bg.durable = if wait { dir.wait()? } else { dir.poll()? };
            if let Some(path) = &bg.durable {
                self.sinks.checkpoint(bg.step, path);
            }
        }
        Ok(())
    }

    /// Rank 0 writes; the others build nothing.
    pub(crate) fn checkpoint(
        &mut self,
        vs: &VarStore,
        opt: &[Optimizer],
    ) -> Result<(), TrainError> {
        if !self.pg.is_main() {
            return Ok(());
        }
        self.settle(true)?;
        if let Some(dir) = &self.dir {
            let values = self.values();
            // The run ended at the background checkpoint's step with nothing changed
            // since: it is the final checkpoint (not written twice).
            let steps = self.steps;
            let done = self.background.take().and_then(|bg| {
                let same = bg.step == steps && bg.values == values;
                bg.durable.filter(|_| same)
            });
            self.last_ckpt = match done {
                Some(path) => Some(path),
                None => {
                    let path = save_parts(dir, self.steps, vs, opt, &self.batches, &values)?;
                    if let Some(path) = &path {
                        self.sinks.checkpoint(self.steps, path);
                    }
                    path
                }
            };
        }
        Ok(())
    }
}
