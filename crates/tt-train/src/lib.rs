#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batches;
#[cfg(feature = "tch")]
mod blocks;
#[cfg(feature = "dist")]
mod config;
mod curve;
mod error;
#[cfg(feature = "dist")]
mod eval;
#[cfg(feature = "dist")]
mod fit;
mod heap;
#[cfg(feature = "dist")]
mod micro;
#[cfg(feature = "tch")]
mod precision;
#[cfg(feature = "dist")]
mod prefetch;
#[cfg(feature = "dist")]
mod report;
#[cfg(feature = "dist")]
mod run;
mod signals;
#[cfg(feature = "dist")]
mod sinks;
#[cfg(feature = "tch")]
mod state;
#[cfg(feature = "dist")]
mod step;
pub mod tensorboard;
#[cfg(feature = "dist")]
mod trainer;
#[cfg(feature = "dist")]
mod work;

pub use batches::{Batch, EpochBatches};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use blocks::{clip_grad_norm, micro_batches, step_seed};
pub use curve::loss_curve_svg;
pub use error::TrainError;
pub use heap::{keep_freed_memory, FreedMemory, MALLOC_VARIABLES};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use precision::{GradScaler, Precision};
pub use signals::{install_signal_handlers, EXIT_PREEMPTED};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use state::{TrainState, Values};
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub use trainer::Trainer;
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub use {
    config::TrainConfig,
    report::{FitOutcome, FitReport},
    sinks::{Console, EvalRecord, JsonLines, LogRecord, Logger, LossCurve, RunStart, TensorBoard},
    work::{BoxError, Direction, Eval, Optimizers, StepContext, Steps},
};
