//! The description of the work [`Trainer::fit`](crate::Trainer::fit) does: the step,
//! whether its batches are prepared ahead, and the held-out evaluation.

use std::any::Any;
use std::ops::Range;

use tch::{Device, Tensor};
use tt_optim::Optimizer;

/// An error from a step, loader or evaluation function, of any type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the step, loader and evaluation functions get.
#[derive(Debug, Clone)]
pub struct StepContext<'a> {
    /// This rank's sample indices for this micro-batch.
    pub indices: &'a [u64],
    /// This process's device (per `LOCAL_RANK`).
    pub device: Device,
    /// The epoch.
    pub epoch: u64,
    /// Steps finished before this one (over the whole run, resumes included).
    pub step: u64,
    /// Which micro-batch of the step this is (0-based; see
    /// [`TrainConfig::accumulate`](crate::TrainConfig::accumulate)).
    pub micro_batch: usize,
    /// How many micro-batches this step has.
    pub micro_batches: usize,
}

/// A function from a context to a one-element tensor (a loss or a metric).
pub(crate) type ScalarFn<'f> = Box<dyn FnMut(&StepContext<'_>) -> Result<Tensor, BoxError> + 'f>;
/// A prepared batch, of the type the user's loader returns.
pub(crate) type Prepared = Box<dyn Any + Send>;
/// The user's loader, its batch boxed.
pub(crate) type LoadFn<'f> =
    Box<dyn FnMut(&StepContext<'_>) -> Result<Prepared, BoxError> + Send + 'f>;
/// The user's step on a prepared batch.
pub(crate) type PreparedStepFn<'f> =
    Box<dyn FnMut(&StepContext<'_>, Prepared) -> Result<Tensor, BoxError> + 'f>;

/// How the step gets its data.
pub(crate) enum Feed<'f> {
    /// The step builds its batch itself.
    Direct(ScalarFn<'f>),
    /// A loader thread builds each micro-batch ahead.
    Prefetched {
        load: LoadFn<'f>,
        step: PreparedStepFn<'f>,
    },
}

/// The work of one [`Trainer::fit`](crate::Trainer::fit): the step function, the
/// loader that prepares its batches ahead if any, and the held-out evaluation if any.
///
/// ```no_run
/// # use tch::{nn::{self, Module}, Kind, Tensor};
/// # use tt_optim::{Optimizer, SgdConfig};
/// use tt_train::{Eval, Steps, TrainConfig, Trainer};
/// # let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3))?;
/// # let mut vs = nn::VarStore::new(trainer.device());
/// # let net = nn::linear(vs.root(), 8, 1, Default::default());
/// # let mut opt = Optimizer::sgd(&vs, SgdConfig::default())?;
/// let features = Tensor::randn([1100, 8], (Kind::Float, tch::Device::Cpu));
/// let rows = |ctx: &tt_train::StepContext<'_>| {
///     let idx: Vec<i64> = ctx.indices.iter().map(|&i| i as i64).collect();
///     features.f_index_select(0, &Tensor::from_slice(&idx))?.f_to_device(ctx.device)
/// };
/// let loss = |x: &Tensor| net.forward(x).pow_tensor_scalar(2).f_mean(Kind::Float);
/// let work = Steps::new(|ctx| loss(&rows(ctx)?))
///     // Every 100 steps and at the end, on samples 1024..1100, 25 a batch.
///     .eval(Eval::lower_is_better(100, 1024..1100, 25, |ctx| loss(&rows(ctx)?)));
/// let report = trainer.fit(&mut vs, &mut opt, work)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Steps<'f> {
    pub(crate) feed: Feed<'f>,
    pub(crate) eval: Option<Eval<'f>>,
}

impl std::fmt::Debug for Steps<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let feed = match self.feed {
            Feed::Direct(_) => "direct",
            Feed::Prefetched { .. } => "prefetched",
        };
        f.debug_struct("Steps")
            .field("feed", &feed)
            .field("eval", &self.eval)
            .finish()
    }
}

impl<'f> Steps<'f> {
    /// `step` computes this rank's loss (a scalar tensor) for a micro-batch of sample
    /// indices; its error, of any type, ends the training with
    /// [`TrainError::Step`](crate::TrainError::Step) with the error as its `cause`
    /// (said in the message, not also as `source()`; downcast `cause` to reach it).
    pub fn new<F, E>(mut step: F) -> Steps<'f>
    where
        F: FnMut(&StepContext<'_>) -> Result<Tensor, E> + 'f,
        E: Into<BoxError>,
    {
        Steps {
            feed: Feed::Direct(Box::new(move |ctx| step(ctx).map_err(Into::into))),
            eval: None,
        }
    }

    /// The batches prepared ahead on a loader thread: `load` builds a micro-batch's
    /// data (tensors, or anything `Send`) from the context the step will get (its
    /// indices, device, epoch, step) while the current step runs; `step` then gets the
    /// context and that batch. Up to [`TrainConfig::prefetch`](crate::TrainConfig::prefetch)
    /// micro-batches are prepared ahead; the order is the sampler's, and the
    /// checkpointed data position is that of the steps done, not of the batches
    /// prepared, so a resume is as exact as without a loader.
    ///
    /// `load` runs on another thread, so it must not draw from libtorch's global
    /// random generator (the trainer seeds it for the step, see
    /// [`TrainConfig::seed_every_step`](crate::TrainConfig::seed_every_step)): derive
    /// any random augmentation from the indices and epoch. An error from `load` ends
    /// the training as a step error does; a panic in it ends it with an error that says
    /// so. A `Tensor` can move to another thread but not be shared: move it, or a
    /// `shallow_clone` of it, into the loader.
    ///
    /// ```no_run
    /// # use tch::{nn::{self, Module}, Kind, Tensor};
    /// # use tt_optim::{Optimizer, SgdConfig};
    /// # use tt_train::{Steps, TrainConfig, Trainer};
    /// # let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3))?;
    /// # let mut vs = nn::VarStore::new(trainer.device());
    /// # let net = nn::linear(vs.root(), 8, 1, Default::default());
    /// # let mut opt = Optimizer::sgd(&vs, SgdConfig::default())?;
    /// let features = Tensor::randn([1024, 8], (Kind::Float, tch::Device::Cpu));
    /// let work = Steps::prefetched(
    ///     // On the loader thread: gather the rows and move them to the device.
    ///     move |ctx| {
    ///         let idx: Vec<i64> = ctx.indices.iter().map(|&i| i as i64).collect();
    ///         features.f_index_select(0, &Tensor::from_slice(&idx))?.f_to_device(ctx.device)
    ///     },
    ///     |_ctx, x: Tensor| net.forward(&x).pow_tensor_scalar(2).f_mean(Kind::Float),
    /// );
    /// let report = trainer.fit(&mut vs, &mut opt, work)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prefetched<L, B, F, E>(mut load: L, mut step: F) -> Steps<'f>
    where
        L: FnMut(&StepContext<'_>) -> Result<B, E> + Send + 'f,
        B: Send + 'static,
        F: FnMut(&StepContext<'_>, B) -> Result<Tensor, E> + 'f,
        E: Into<BoxError>,
    {
        let load: LoadFn<'f> = Box::new(move |ctx| match load(ctx) {
            Ok(batch) => Ok(Box::new(batch) as Prepared),
            Err(e) => Err(e.into()),
        });
        let step: PreparedStepFn<'f> = Box::new(move |ctx, batch| {
            let batch = batch
                .downcast::<B>()
                .map_err(|_| "the loader's batch is not of the step's type")?;
            step(ctx, *batch).map_err(Into::into)
        });
        Steps {
            feed: Feed::Prefetched { load, step },
            eval: None,
        }
    }

    /// With a held-out evaluation (see [`Eval`]).
    pub fn eval(mut self, eval: Eval<'f>) -> Steps<'f> {
        self.eval = Some(eval);
        self
    }
}

/// Whether a lower or a higher metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Lower is better (a loss, an error rate, a perplexity).
    LowerIsBetter,
    /// Higher is better (an accuracy, a BLEU score).
    HigherIsBetter,
}

impl Direction {
    /// Whether `value` is better than `best` (a NaN is never better, nor the first).
    pub fn improves(self, value: f64, best: Option<f64>) -> bool {
        !value.is_nan()
            && best.is_none_or(|b| match self {
                Direction::LowerIsBetter => value < b,
                Direction::HigherIsBetter => value > b,
            })
    }
}

/// A held-out evaluation during training: every `every` steps and after the last,
/// `metric` runs without gradients on this rank's share of the held-out indices (rank
/// `r` takes every `world_size`-th index from the `r`-th) in batches, and returns each
/// batch's mean metric (a scalar tensor). The trainer averages it over every held-out
/// sample of every rank, logs it, and with a checkpoint directory keeps the checkpoint
/// of the best evaluation so far in `<dir>/best` (the best survives resumes).
pub struct Eval<'f> {
    pub(crate) every: u64,
    pub(crate) held_out: Range<u64>,
    pub(crate) batch_size: usize,
    pub(crate) direction: Direction,
    pub(crate) metric: ScalarFn<'f>,
}

impl std::fmt::Debug for Eval<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eval")
            .field("every", &self.every)
            .field("held_out", &self.held_out)
            .field("batch_size", &self.batch_size)
            .field("direction", &self.direction)
            .finish_non_exhaustive()
    }
}

impl<'f> Eval<'f> {
    /// A metric where lower is better, such as the loss.
    pub fn lower_is_better<G, E>(
        every: u64,
        held_out: Range<u64>,
        batch_size: usize,
        metric: G,
    ) -> Eval<'f>
    where
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E> + 'f,
        E: Into<BoxError>,
    {
        Eval::new(
            every,
            held_out,
            batch_size,
            Direction::LowerIsBetter,
            metric,
        )
    }

    /// A metric where higher is better, such as an accuracy.
    pub fn higher_is_better<G, E>(
        every: u64,
        held_out: Range<u64>,
        batch_size: usize,
        metric: G,
    ) -> Eval<'f>
    where
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E> + 'f,
        E: Into<BoxError>,
    {
        Eval::new(
            every,
            held_out,
            batch_size,
            Direction::HigherIsBetter,
            metric,
        )
    }

    /// A metric in the given direction. Its error, of any type, ends the training with
    /// [`TrainError::Eval`](crate::TrainError::Eval) and the error as its `cause`.
    pub fn new<G, E>(
        every: u64,
        held_out: Range<u64>,
        batch_size: usize,
        direction: Direction,
        mut metric: G,
    ) -> Eval<'f>
    where
        G: FnMut(&StepContext<'_>) -> Result<Tensor, E> + 'f,
        E: Into<BoxError>,
    {
        Eval {
            every,
            held_out,
            batch_size,
            direction,
            metric: Box::new(move |ctx| metric(ctx).map_err(Into::into)),
        }
    }

    /// The schedule checked (before any step runs).
    pub(crate) fn validate(&self) -> Result<(), crate::TrainError> {
        if self.every == 0 || self.batch_size == 0 || self.held_out.is_empty() {
            return Err(crate::TrainError::Config {
                reason: format!(
                    "eval: every {} steps, batch {} over {:?}: give every > 0, batch_size > 0 \
                 and a non-empty range of held-out indices",
                    self.every, self.batch_size, self.held_out
                ),
            });
        }
        Ok(())
    }
}

/// The optimizers one [`Trainer::fit`](crate::Trainer::fit) steps after each step: one
/// (`&mut opt`), or one per parameter group (`&mut [body, head]`, a `&mut Vec`), built
/// with [`Optimizer::with_params`](tt_optim::Optimizer::with_params). The groups must
/// not overlap (checked before the first step); each optimizer's state goes into the
/// checkpoints and is resumed; the first one's learning rate is the one logged.
pub struct Optimizers<'o>(pub(crate) &'o mut [Optimizer]);

impl std::fmt::Debug for Optimizers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<Vec<&str>> = self.0.iter().map(Optimizer::params).collect();
        f.debug_tuple("Optimizers").field(&groups).finish()
    }
}

impl<'o> From<&'o mut Optimizer> for Optimizers<'o> {
    fn from(opt: &'o mut Optimizer) -> Self {
        Optimizers(std::slice::from_mut(opt))
    }
}

impl<'o> From<&'o mut [Optimizer]> for Optimizers<'o> {
    fn from(opts: &'o mut [Optimizer]) -> Self {
        Optimizers(opts)
    }
}

impl<'o, const N: usize> From<&'o mut [Optimizer; N]> for Optimizers<'o> {
    fn from(opts: &'o mut [Optimizer; N]) -> Self {
        Optimizers(opts)
    }
}

impl<'o> From<&'o mut Vec<Optimizer>> for Optimizers<'o> {
    fn from(opts: &'o mut Vec<Optimizer>) -> Self {
        Optimizers(opts)
    }
}

impl Optimizers<'_> {
    /// No parameter in two optimizers, and at least one optimizer.
    pub(crate) fn validate(&self) -> Result<(), crate::TrainError> {
        if self.0.is_empty() {
            return Err(crate::TrainError::Config {
                reason: "no optimizer: give one, or one per parameter group".into(),
            });
        }
        let mut seen = std::collections::HashMap::new();
        for (i, opt) in self.0.iter().enumerate() {
            for name in opt.params() {
                if let Some(j) = seen.insert(name.to_owned(), i) {
                    return Err(crate::TrainError::Config {
                        reason: format!(
                            "the parameter {name:?} is in optimizers {j} and {i}: give each \
                         parameter group to one optimizer (Optimizer::with_params)"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}
