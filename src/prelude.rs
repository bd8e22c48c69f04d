//! The names most training programs use, in one import:
//! `use torchtools::prelude::*;`.

pub use crate::{init_logging, reserve_gpu_for_training, Reservation, ReserveOptions};
pub use tt_device::Bytes;

#[cfg(feature = "tch")]
pub use crate::{run_training_with_reservation, RunOptions};
#[cfg(feature = "tch")]
pub use tt_optim::Optimizer;
#[cfg(feature = "tch")]
pub use tt_train::{EpochBatches, TrainState};

#[cfg(feature = "dist")]
pub use tt_train::{Eval, FitOutcome, Steps, TrainConfig, Trainer};
