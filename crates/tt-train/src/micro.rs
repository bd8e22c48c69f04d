//! The adaptive micro-batch of [`TrainConfig::adaptive_micro_batch`](crate::TrainConfig::adaptive_micro_batch):
//! searched on the first step, agreed over the ranks.

use tch::Tensor;
use tt_adaptive::{Adaptive, AdaptiveError, Cache, Policy};
use tt_optim::Optimizer;

use crate::run::Run;
use crate::step::micro_contexts;
use crate::work::{BoxError, StepContext};
use crate::{Batch, TrainError};

impl Run<'_> {
    /// Searches the micro-batch on the run's first batch when the configuration asks
    /// for it and neither an earlier search nor the checkpoint gave one (a no-op
    /// otherwise): the one place both feeds of `fit` find it, before their first step.
    pub(crate) fn ensure_micro_batch(
        &mut self,
        opt: &mut [Optimizer],
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
    ) -> Result<(), TrainError> {
        if !self.config.adaptive_micro_batch || self.micro.is_some() {
            return Ok(());
        }
        if let Some(batch) = self.batches.clone().next_batch()? {
            self.micro = Some(search(self, opt, &batch, step)?);
        }
        Ok(())
    }
}

/// The largest micro-batch, from `batch_size / accumulate` down by halves, whose
/// forward and backward fit on this rank, then the smallest over the ranks. Each try
/// runs the step function on the first (the largest) micro-batch a step of that size
/// has, split as the steps split, with the gradients kept local (no collective: the
/// ranks may try different sizes), and leaves no gradient behind.
fn search(
    run: &mut Run<'_>,
    opt: &mut [Optimizer],
    batch: &Batch,
    step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
) -> Result<usize, TrainError> {
    let indices = &batch.indices;
    let start = indices.len().div_ceil(run.config.accumulate).max(1);
    let mut tried = Vec::new();
    let adaptive = Adaptive::new().policy(Policy::Halve).cache(Cache::None);
    let found = adaptive.batch(start, |m| -> Result<usize, BoxError> {
        tried.push(m);
        // The first of the micro-batches a step of size `m` would have.
        let split = (run.config.accumulate, Some(m));
        let contexts = micro_contexts(split, run.device, indices, batch.epoch, run.steps);
        let Some(ctx) = contexts.first() else {
            return Ok(m); // an empty batch: nothing to try
        };
        opt.iter_mut().for_each(Optimizer::zero_grad);
        let tried = run.micro_step(ctx, 1.0, false, step);
        opt.iter_mut().for_each(Optimizer::zero_grad);
        tried.map(|_| m)
    });
    let step = run.steps;
    let mine = match found {
        Ok(m) => m,
        Err(AdaptiveError::Failed(cause)) => {
            return Err(TrainError::MicroBatch {
                step,
                no_fit: false,
                cause,
            })
        }
        Err(AdaptiveError::NoFit { cause, reason, .. }) => {
            return Err(TrainError::MicroBatch {
                step,
                no_fit: true,
                cause: cause.unwrap_or_else(|| reason.into()),
            })
        }
    };
    let agreed = run.pg.min_over_ranks(mine as u64)?;
    let agreed = usize::try_from(agreed).unwrap_or(mine).max(1);
    if run.pg.is_main() {
        tracing::info!(
            micro_batch = agreed,
            per_step = indices.len().div_ceil(agreed),
            tried = ?tried,
            "micro-batch found"
        );
    }
    Ok(agreed)
}
