//! Resumable training on libtorch (through [`tch`]): the training loop's parts that the
//! Python tools scatter, as one crate.
//!
//! - [`Trainer`] (feature `dist`, on by default): one training loop for one process or
//!   many, as torchhandy's `Parallel_Trainer`: torch's `DistributedSampler` order, DDP
//!   on libtorch's c10d (Gloo, NCCL), loss averaged over the ranks, rank-0 checkpoints
//!   of parameters, optimizer and sampler, an exact resume, and preemption (SIGTERM)
//!   that checkpoints, stops every rank at the same step and exits with
//!   [`EXIT_PREEMPTED`].
//! - [`TrainState`] (feature `tch`): for a loop of your own, parameters, optimizer and
//!   data position saved and resumed in one call, as the Python cycling_utils'
//!   `AtomicDirectory` and interruptible sampler do together.
//! - [`EpochBatches`] (no libtorch): this rank's batches across epochs, resumable
//!   mid-epoch.
//! - [`tensorboard::EventWriter`] and [`loss_curve_svg`] (no libtorch): the trainer's
//!   metrics as TensorBoard event files and as an SVG loss curve.
//!
//! # Example
//!
//! The same program trains alone (`cargo run`) or as N ranks (`torchtools launch
//! --nproc-per-node N`, or `torchrun --no-python`):
//!
//! ```no_run
//! # #[cfg(feature = "dist")] {
//! use tch::nn::{self, Module};
//! use tch::{Kind, Tensor};
//! use tt_optim::{Optimizer, SgdConfig};
//! use tt_train::{TrainConfig, Trainer};
//!
//! let mut trainer = Trainer::from_env(TrainConfig::new(1024, 32, 3).checkpoints("ckpt", 100))?;
//! let mut vs = nn::VarStore::new(trainer.device());
//! let net = nn::linear(vs.root(), 8, 1, Default::default());
//! let mut opt = Optimizer::sgd(&vs, SgdConfig { lr: 0.1, ..Default::default() })?;
//! let report = trainer.fit(&mut vs, &mut opt, |ctx| {
//!     let idx = Tensor::from_slice(&ctx.indices.iter().map(|&i| i as f32).collect::<Vec<_>>());
//!     let x = (idx.unsqueeze(1) * Tensor::ones([1, 8], (Kind::Float, ctx.device))).sin();
//!     net.forward(&x).pow_tensor_scalar(2).f_mean(Kind::Float)
//! })?;
//! println!("{:?} after {} steps", report.outcome, report.steps);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batches;
mod curve;
mod error;
mod signals;
#[cfg(feature = "tch")]
mod state;
pub mod tensorboard;
#[cfg(feature = "dist")]
mod trainer;

pub use batches::{Batch, EpochBatches};
pub use curve::loss_curve_svg;
pub use error::TrainError;
pub use signals::{install_signal_handlers, EXIT_PREEMPTED};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use state::{TrainState, Values};
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub use trainer::{
    EvalConfig, FitOutcome, FitReport, Precision, StepContext, TrainConfig, Trainer,
};
