//! The loader thread of [`Steps::prefetched`](crate::Steps::prefetched): micro-batches
//! prepared ahead while the current step runs.

use tch::nn::VarStore;
use tch::Tensor;
use tt_optim::Optimizer;

use crate::run::Run;
use crate::step::micro_contexts;
use crate::work::{BoxError, Eval, LoadFn, Prepared, PreparedStepFn, StepContext};
use crate::{FitReport, TrainError};

/// One micro-batch from the loader, with where it belongs.
struct Loaded {
    step: u64,
    indices: Vec<u64>,
    data: Result<Prepared, BoxError>,
}

/// The run's loop (`Run::train`) with a loader thread beside it: the loader walks a copy of the
/// batches (the run's own position moves only with the steps done) and sends each
/// micro-batch's data through a channel of [`TrainConfig::prefetch`](crate::TrainConfig::prefetch)
/// places.
pub(crate) fn fit(
    mut run: Run<'_>,
    vs: &mut VarStore,
    opt: &mut [Optimizer],
    mut load: LoadFn<'_>,
    mut step: PreparedStepFn<'_>,
    eval: Option<&mut Eval<'_>>,
) -> Result<FitReport, TrainError> {
    // The adaptive micro-batch is searched before the loader starts (on this thread,
    // `load` building the tries' batches), so that the loader splits every batch as
    // the steps will.
    let mut trial = |ctx: &StepContext<'_>| step(ctx, load(ctx)?);
    run.ensure_micro_batch(opt, &mut trial)?;
    let mut ahead = run.batches.clone();
    let first = run.steps;
    let (split, device) = ((run.config.accumulate, run.micro), run.device);
    let prefetch = run.config.prefetch;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Loaded>(prefetch);
        let loader = std::thread::Builder::new()
            .name("tt-train-loader".into())
            .spawn_scoped(scope, move || {
                let _guard = tch::no_grad_guard();
                load_ahead(&mut ahead, first, (split, device), &mut load, &tx);
            })
            .map_err(|cause| TrainError::Io {
                what: "starting the batch-loader thread".into(),
                cause,
            })?;
        // Owns the receiver: once it is dropped, the loader's next send fails and it
        // stops.
        let mut take = move |ctx: &StepContext<'_>| -> Result<Tensor, BoxError> {
            let loaded = rx.recv().map_err(|_| {
                "the batch loader stopped without a batch (it panicked: see its message)"
            })?;
            if loaded.step != ctx.step || loaded.indices != ctx.indices {
                return Err(format!(
                    "the prefetched batch (step {}, indices {:?}) is not the step's (step {}, \
                     indices {:?})",
                    loaded.step, loaded.indices, ctx.step, ctx.indices
                )
                .into());
            }
            step(ctx, loaded.data?)
        };
        let report = run.train(vs, opt, &mut take, eval);
        // The receiver goes with it: a loader blocked on a full channel wakes and stops.
        drop(take);
        match loader.join() {
            Ok(()) => report,
            Err(_) => report.and(Err(TrainError::Step {
                step: first,
                cause: "the batch loader panicked (see its message)".into(),
            })),
        }
    })
}

/// The loader thread's work: each micro-batch of the batches from step `first` on,
/// loaded and sent, until the batches end or the receiver is gone.
fn load_ahead(
    ahead: &mut crate::EpochBatches,
    first: u64,
    (split, device): ((usize, Option<usize>), tch::Device),
    load: &mut LoadFn<'_>,
    tx: &std::sync::mpsc::SyncSender<Loaded>,
) {
    for step in first.. {
        let batch = match ahead.next_batch() {
            Ok(Some(batch)) => batch,
            Ok(None) => return,
            Err(e) => {
                let (indices, data) = (Vec::new(), Err(e.into()));
                let _ = tx.send(Loaded {
                    step,
                    indices,
                    data,
                });
                return;
            }
        };
        let contexts = micro_contexts(split, device, &batch.indices, batch.epoch, step);
        for ctx in contexts {
            let data = load(&ctx);
            let indices = ctx.indices.to_vec();
            if tx
                .send(Loaded {
                    step,
                    indices,
                    data,
                })
                .is_err()
            {
                return; // the training ended
            }
        }
    }
}
