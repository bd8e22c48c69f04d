//! The held-out evaluation of a running [`Trainer::fit`](crate::Trainer::fit).

use tch::nn::VarStore;
use tch::Tensor;
use tt_dist::ReduceOp;
use tt_optim::Optimizer;

use crate::run::Run;
use crate::sinks::EvalRecord;
use crate::state::save_parts;
use crate::work::{BoxError, Eval, StepContext};
use crate::TrainError;

impl Run<'_> {
    /// Runs the evaluation on this rank's share of the held-out indices, averages over
    /// every held-out sample of every rank, logs, and keeps the best checkpoint.
    pub(crate) fn evaluate(
        &mut self,
        vs: &VarStore,
        opt: &[Optimizer],
        epoch: u64,
        eval: &mut Eval<'_>,
    ) -> Result<(), TrainError> {
        let (steps, pg) = (self.steps, self.pg);
        let failed = |cause: BoxError| TrainError::Eval { step: steps, cause };
        let (world, rank) = (pg.world_size() as u64, pg.rank() as u64);
        let start = eval.held_out.start;
        let mine: Vec<u64> = eval
            .held_out
            .clone()
            .filter(|i| (i - start) % world == rank)
            .collect();
        let dev = pg.scalar_device();
        let mut sum = Tensor::zeros([1], (tch::Kind::Double, dev));
        {
            let _guard = tch::no_grad_guard();
            for part in mine.chunks(eval.batch_size) {
                let ctx = StepContext {
                    indices: part,
                    device: self.device,
                    epoch,
                    step: steps,
                    micro_batch: 0,
                    micro_batches: 1,
                };
                sum += weighted(&mut eval.metric, &ctx, dev).map_err(failed)?;
            }
        }
        let count = Tensor::full([1], mine.len() as f64, (tch::Kind::Double, dev));
        let both = Tensor::cat(&[sum, count], 0);
        pg.all_reduce(&both, ReduceOp::Sum)?;
        let value = both.double_value(&[0]) / both.double_value(&[1]).max(1.0);
        self.evals.push((steps, value));
        let improved = eval.direction.improves(value, self.best.map(|(_, b)| b));
        if pg.is_main() {
            self.sinks.eval(&EvalRecord {
                step: steps,
                epoch,
                value,
                improved,
            });
        }
        if improved {
            self.best = Some((steps, value));
            if let (Some(best_dir), true) = (&self.best_dir, pg.is_main()) {
                save_parts(best_dir, steps, vs, opt, &self.batches, &self.values())?;
            }
        }
        Ok(())
    }
}

/// One batch's metric times its samples, as a one-element double on `dev`.
fn weighted(
    metric: &mut crate::work::ScalarFn<'_>,
    ctx: &StepContext<'_>,
    dev: tch::Device,
) -> Result<Tensor, BoxError> {
    let value = metric(ctx)?;
    if value.numel() != 1 {
        return Err(format!(
            "the evaluation must return a scalar, not a tensor of shape {:?}",
            value.size()
        )
        .into());
    }
    let value = value
        .f_to_kind(tch::Kind::Double)?
        .f_reshape([1])?
        .f_to_device(dev)?;
    Ok(value * ctx.indices.len() as f64)
}
