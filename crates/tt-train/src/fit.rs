//! The loop of a started run: its steps, the loss agreed over the ranks and logged,
//! the evaluations and checkpoints between them, and its end.

use std::sync::atomic::Ordering;

use tch::nn::VarStore;
use tch::Tensor;
use tt_dist::ReduceOp;
use tt_optim::Optimizer;

use crate::run::Run;
use crate::sinks::LogRecord;
use crate::work::{BoxError, Eval, StepContext};
use crate::{FitOutcome, FitReport, TrainError};

impl Run<'_> {
    /// The loop over the batches of a started run.
    pub(crate) fn train(
        mut self,
        vs: &mut VarStore,
        opt: &mut [Optimizer],
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
        mut eval: Option<&mut Eval<'_>>,
    ) -> Result<FitReport, TrainError> {
        let mut epoch = 0;
        while let Some(batch) = self.batches.next_batch()? {
            epoch = batch.epoch;
            // The first optimizer's rate is the one logged.
            let lr = opt.first().map_or(0.0, Optimizer::lr);
            let loss = self.step(opt, &batch.indices, batch.epoch, step)?;
            self.sinks.step(self.steps);
            if self.agree(loss, batch.epoch, lr)? {
                return self.finish(vs, opt, FitOutcome::Preempted, batch.epoch);
            }
            if let Some(eval) = eval.as_deref_mut() {
                if self.steps % eval.every == 0 {
                    self.evaluate(vs, opt, batch.epoch, eval)?;
                }
            }
            if self.config.checkpoint_every > 0 && self.steps % self.config.checkpoint_every == 0 {
                self.checkpoint_in_background(vs, opt)?;
            } else if self.pg.is_main() {
                self.settle(false)?;
            }
        }
        if let Some(mean) = self.window.take_mean() {
            self.losses.push((self.steps, mean));
        }
        if let Some(eval) = eval {
            // Steps that are multiples of `every` were evaluated in the loop.
            if self.steps % eval.every != 0 {
                self.evaluate(vs, opt, epoch, eval)?;
            }
        }
        let epochs = self.config.epochs;
        self.finish(vs, opt, FitOutcome::Finished, epochs)
    }

    /// One small all-reduce a step: the loss summed over the ranks (for the log) and
    /// whether any rank was signalled, so that all stop after the same step. Logs
    /// every `log_every` steps; returns whether to stop.
    ///
    /// One process alone reads nothing from the device; several read the reduced stop
    /// flag, the step's one host sync (all ranks must agree on when to stop).
    fn agree(&mut self, loss: Tensor, epoch: u64, lr: f64) -> Result<bool, TrainError> {
        let stop_here = self.stop.load(Ordering::SeqCst);
        let any_stop = if self.pg.backend().is_none() {
            self.window.add(loss);
            stop_here
        } else {
            // On the group's device (NCCL reduces only CUDA tensors); the flag is
            // written there by a kernel, not copied from the host (a copy would wait).
            let dev = self.pg.scalar_device();
            let flag = f64::from(u8::from(stop_here));
            let stop = Tensor::full([1], flag, (tch::Kind::Double, dev));
            let flags = Tensor::cat(&[loss.to_device(dev), stop], 0);
            self.pg.all_reduce(&flags, ReduceOp::Sum)?;
            self.window
                .add(flags.narrow(0, 0, 1) / self.pg.world_size() as f64);
            flags.double_value(&[1]) > 0.0
        };
        if self.steps % self.config.log_every == 0 || any_stop {
            if let Some(mean) = self.window.take_mean() {
                self.losses.push((self.steps, mean));
                if self.pg.is_main() {
                    self.log(epoch, mean, lr);
                }
            }
        }
        Ok(any_stop)
    }

    /// Rank 0's log record, to every logger.
    fn log(&mut self, epoch: u64, loss: f64, lr: f64) {
        let grad_norm = self.grad_norm.as_ref().map(|n| n.double_value(&[]));
        let (samples, since) =
            std::mem::replace(&mut self.since_log, (0, std::time::Instant::now()));
        // Samples of all ranks per second.
        let samples_per_s = (samples * self.pg.world_size() as u64) as f64
            / since.elapsed().as_secs_f64().max(1e-9);
        self.sinks.log(&LogRecord {
            step: self.steps,
            epoch,
            loss,
            lr,
            grad_norm,
            samples_per_s,
            micro_batch: self.micro,
        });
    }

    /// The last checkpoint, the barrier, the report (to the loggers too).
    fn finish(
        mut self,
        vs: &VarStore,
        opt: &[Optimizer],
        outcome: FitOutcome,
        epoch: u64,
    ) -> Result<FitReport, TrainError> {
        self.checkpoint(vs, opt)?;
        self.pg.barrier()?;
        let report = FitReport {
            outcome,
            steps: self.steps,
            epoch,
            resumed_from: self.resumed_from,
            losses: self.losses,
            checkpoint: self.last_ckpt,
            evals: self.evals,
            best: self.best,
            skipped_steps: self.skipped,
            loss_scale: self.scaler.map(|s| s.scale()),
            micro_batch: self.micro,
        };
        self.sinks.finish(&report);
        Ok(report)
    }
}
