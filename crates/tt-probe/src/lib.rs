#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
mod child;
mod command;
mod error;
mod report;
#[cfg(feature = "tch")]
mod run;
#[cfg(feature = "tch")]
mod rust_probe;

pub use batch::{max_batch, BatchSearch, MaxBatch, MemoryLine, PROBE_BATCH_ENV};
pub use command::{probe_command, CommandProbe, PROBE_ENV, PROBE_STEPS_ENV};
pub use error::{ProbeError, Result};
pub use report::{EstimatePolicy, MemoryKind, ProbeReport};
#[cfg(feature = "tch")]
pub use run::{run_training_with_reservation, RunError, RunOptions, RunPlan};
#[cfg(feature = "tch")]
pub use rust_probe::{
    entry, probe, BoxError, Loss, ProbeContext, ProbeFn, ProbeOptions, ProbeSpec, Step,
    PROBE_RUN_ENV,
};
