//! Measure a training step's peak memory in a fresh child process, and turn it into the
//! bytes to reserve (the Python torchtools' `estimate_gpu_usage_by_probe` / `make_probe_fn`, without
//! its low estimates).
//!
//! Two ways to probe:
//!
//! 1. **A Rust probe** (feature `tch`): a closure cannot cross an `exec`, so probes are
//!    registered by name: [`entry`] called first in `main` with the table turns the
//!    re-executed child into the probe runner, and [`probe`] runs one and returns a
//!    [`ProbeReport`]: the caching allocator's peak allocated and reserved bytes, NVML's
//!    per-process peak (which includes the CUDA context), steps, duration. Under
//!    `cargo test`, [`ProbeOptions::in_test`] re-runs the test binary with `--exact`.
//!    [`ProbeSpec`] builds a probe from a model, a batch shape, a loss and an optimizer;
//!    a step is forward + backward + optimizer step.
//! 2. **Any command** (core, no libtorch): [`probe_command`] runs it with
//!    `TORCHTOOLS_PROBE=1` and `TORCHTOOLS_PROBE_STEPS=N` until it exits or the timeout,
//!    sampling NVML per-process memory of its whole process tree: Python scripts too.
//!
//! Without a GPU, a probe reports the peak RSS growth (the kernel's high-water mark)
//! and says it is CPU memory, so the probe → reserve → train flow runs anywhere.
//! [`ProbeReport::estimate`] = peak × (1 + fraction) + margin, rounded up (see
//! [`EstimatePolicy`]). Failures (OOM, crash, non-zero exit, timeout) are
//! [`ProbeError`]s with the exit status and the tail of the child's stderr; the child is
//! always reaped, its process group killed at the timeout.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tt_probe::{probe_command, CommandProbe, EstimatePolicy, MemoryKind};
//!
//! // A command that allocates 64 MiB (a Python script would read TORCHTOOLS_PROBE_STEPS).
//! let report = probe_command(
//!     &"sh".into(),
//!     &["-c".into(), "head -c 67108864 /dev/zero | tail -c 1 >/dev/null".into()],
//!     &CommandProbe { timeout: Duration::from_secs(30), ..CommandProbe::default() },
//! )?;
//! assert_eq!(report.memory, MemoryKind::Cpu); // no GPU here
//! println!("{report}; reserve {}", report.estimate(&EstimatePolicy::default()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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
