//! `run_training_with_reservation`: probe (optional) → reserve with the estimate →
//! train → release, as the seed's function of the same name.

use tt_device::Bytes;
use tt_probe::{EstimatePolicy, ProbeError, ProbeOptions, ProbeReport};

use crate::{reserve_gpu_for_training, Reservation, ReserveError, ReserveOptions};

/// What to do before training.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// A probe to run first (its name in the table given to `tt_probe::entry`), and
    /// how; `None` reserves `reserve.training_reserved_bytes` as given.
    pub probe: Option<(String, ProbeOptions)>,
    /// How the probe's peak becomes the bytes to reserve.
    pub estimate: EstimatePolicy,
    /// The reservation; its `training_reserved_bytes` is replaced by the estimate when
    /// a probe runs.
    pub reserve: ReserveOptions,
}

/// Which stage failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The probe failed: nothing was reserved, training did not start.
    #[error("probe stage: {0}")]
    Probe(#[from] ProbeError),
    /// The reservation failed: training did not start.
    #[error("reserve stage: {0}")]
    Reserve(#[from] ReserveError),
}

/// What the flow did before training, for the training code.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The probe's report, when one ran.
    pub probe: Option<ProbeReport>,
    /// The bytes reserved for training.
    pub reserved: Bytes,
}

/// Probes (optional), reserves with the estimate, runs `train` with the reservation,
/// releases it, and returns `train`'s result.
///
/// ```
/// use torchtools::{run_training_with_reservation, RunOptions};
///
/// // No probe: reserve as the options say (on this GPU-less machine: nothing).
/// let result = run_training_with_reservation(
///     |reservation, plan| {
///         println!("training on {:?}, {} reserved", reservation.device(), plan.reserved);
///         42
///     },
///     RunOptions::default(),
/// )?;
/// assert_eq!(result, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn run_training_with_reservation<R>(
    train: impl FnOnce(&mut Reservation, &RunPlan) -> R,
    options: RunOptions,
) -> Result<R, RunError> {
    let mut reserve = options.reserve;
    let probe = match &options.probe {
        Some((name, probe_options)) => {
            let report = tt_probe::probe(name, probe_options)?;
            tracing::info!("{report}");
            reserve.training_reserved_bytes = report.estimate(&options.estimate);
            Some(report)
        }
        None => None,
    };
    let plan = RunPlan {
        probe,
        reserved: reserve.training_reserved_bytes,
    };
    let mut reservation = reserve_gpu_for_training(reserve)?;
    let result = train(&mut reservation, &plan);
    drop(reservation);
    Ok(result)
}
