#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batches;
mod curve;
mod error;
#[cfg(feature = "tch")]
mod precision;
mod signals;
#[cfg(feature = "tch")]
mod state;
pub mod tensorboard;
#[cfg(feature = "dist")]
mod trainer;

pub use batches::{Batch, EpochBatches};
pub use curve::loss_curve_svg;
pub use error::TrainError;
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use precision::{GradScaler, Precision};
pub use signals::{install_signal_handlers, EXIT_PREEMPTED};
#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
pub use state::{TrainState, Values};
#[cfg(feature = "dist")]
#[cfg_attr(docsrs, doc(cfg(feature = "dist")))]
pub use trainer::{EvalConfig, FitOutcome, FitReport, StepContext, TrainConfig, Trainer};
