//! One step of a started run: the user's loss on each micro-batch with its backward,
//! then the scaler, clipping and the optimizer.

use tch::{Device, Tensor};
use tt_optim::Optimizer;

use crate::run::Run;
use crate::work::{BoxError, StepContext};
use crate::TrainError;

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

impl Run<'_> {
    /// One step: the user's loss on each micro-batch with its backward, then the
    /// scaler, clipping and the optimizer. Returns the loss (the batch's, micro-batches
    /// weighted by size), as a one-element double tensor still on its device: nothing
    /// here waits for the GPU.
    pub(crate) fn step(
        &mut self,
        opt: &mut [Optimizer],
        indices: &[u64],
        epoch: u64,
        step: &mut dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError>,
    ) -> Result<Tensor, TrainError> {
        let steps = self.steps;
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
        let split = (self.config.accumulate, self.micro);
        for ctx in micro_contexts(split, self.device, indices, epoch, steps) {
            let share = ctx.indices.len() as f64 / indices.len() as f64;
            let sync = ctx.micro_batch + 1 == ctx.micro_batches;
            let detached = self.micro_step(&ctx, share, sync, step).map_err(failed)?;
            value = Some(match value.take() {
                Some(v) => v + detached,
                None => detached,
            });
        }
        let finite = match &self.scaler {
            Some(scaler) => scaler.unscale(&self.params).map_err(|e| failed(e.into()))?,
            None => true,
        };
        if let Some(max_norm) = self.config.clip_grad_norm {
            let norm = crate::clip_grad_norm(&self.params, max_norm);
            self.grad_norm = Some(norm.map_err(|e| failed(e.into()))?);
        }
        // torch.amp.GradScaler: a step with gradients that are not all finite is
        // skipped and the scale backed off.
        if self.scaler.as_mut().is_none_or(|s| s.update(finite)) {
            for o in opt.iter_mut() {
                o.step()?;
            }
        } else {
            self.skipped += 1;
            let scale = self.scaler.map_or(1.0, |s| s.scale());
            tracing::info!(step = steps, scale, "gradients not finite: step skipped");
        }
        self.steps += 1;
        self.since_log.0 += indices.len() as u64;
        value.ok_or_else(|| failed("an empty batch".into()))
    }

    /// One micro-batch: the user's loss (under autocast), weighted by its `share` of the
    /// batch, scaled for fp16, and its backward (gradients synchronised across the ranks
    /// when `sync`: after the step's last micro-batch). Returns the weighted loss,
    /// detached.
    pub(crate) fn micro_step(
        &mut self,
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
        let loss = match &self.scaler {
            Some(scaler) => scaler.scale_loss(&loss)?,
            None => loss,
        };
        if sync {
            self.ddp.backward(&loss)?;
        } else {
            self.ddp.no_sync(|| self.ddp.backward(&loss))?;
        }
        Ok(detached)
    }
}
