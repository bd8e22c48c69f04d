//! `run_training_with_reservation`: probe (optional) → reserve with the estimate →
//! train → release, as the Python torchtools' function of the same name.

use std::fmt;

use tt_device::Bytes;
use tt_reserve::{Reservation, ReserveOptions};

use crate::{EstimatePolicy, ProbeError, ProbeOptions, ProbeReport};

/// What to do before training.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// A probe to run first (its name in the table given to [`crate::entry`]), and
    /// how; `None` reserves `reserve.training_reserved_bytes` as given.
    pub probe: Option<(String, ProbeOptions)>,
    /// How the probe's peak becomes the bytes to reserve.
    pub estimate: EstimatePolicy,
    /// The reservation; its `training_reserved_bytes` is replaced by the estimate when
    /// a probe runs.
    pub reserve: ReserveOptions,
}

/// Which stage failed, with the stage's error (in the message, and in the variant for
/// matching or downcasting; not also the `source()`, so a chain printer says it once).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The probe failed: nothing was reserved, training did not start.
    #[error("probe stage: {0}")]
    Probe(ProbeError),
    /// The reservation failed: training did not start.
    #[error("reserve stage: {0}")]
    Reserve(tt_reserve::Error),
    /// Training returned an error; the reservation was released.
    #[error("training: {0}")]
    Train(Box<dyn std::error::Error + Send + Sync>),
}

/// What the flow did before training, for the training code.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// The probe's report, when one ran.
    pub probe: Option<ProbeReport>,
    /// The bytes the fence leaves free for training; `None` when nothing was reserved
    /// (`Auto` on a machine without GPUs).
    pub reserved: Option<Bytes>,
}

impl fmt::Display for RunPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reserved {
            Some(bytes) => write!(f, "{bytes} reserved for training")?,
            None => f.write_str("nothing reserved (no GPU on this machine)")?,
        }
        if let Some(report) = &self.probe {
            write!(f, "; probe: {report}")?;
        }
        Ok(())
    }
}

/// Probes (optional), reserves with the estimate, runs `train` with the reservation,
/// releases it, and returns what `train` returned. `train`'s error comes back as
/// [`RunError::Train`], its cause kept.
///
/// ```
/// use tt_probe::{run_training_with_reservation, RunOptions};
///
/// // No probe: reserve as the options say (on a GPU-less machine: nothing).
/// let result = run_training_with_reservation(
///     |reservation, plan| {
///         println!("training on {:?}: {plan}", reservation.gpus());
///         Ok::<_, std::io::Error>(42)
///     },
///     RunOptions::default(),
/// )?;
/// assert_eq!(result, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn run_training_with_reservation<R, E>(
    train: impl FnOnce(&mut Reservation, &RunPlan) -> Result<R, E>,
    options: RunOptions,
) -> Result<R, RunError>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut reserve = options.reserve;
    let probe = match &options.probe {
        Some((name, probe_options)) => {
            let report = crate::probe(name, probe_options).map_err(RunError::Probe)?;
            tracing::info!("{report}");
            reserve.training_reserved_bytes = report.estimate(&options.estimate);
            Some(report)
        }
        None => None,
    };
    let bytes = reserve.training_reserved_bytes;
    let mut reservation = tt_reserve::reserve(reserve).map_err(RunError::Reserve)?;
    let plan = RunPlan {
        probe,
        reserved: (!reservation.is_empty()).then_some(bytes),
    };
    tracing::info!("{plan}");
    let result = train(&mut reservation, &plan);
    drop(reservation);
    result.map_err(|e| RunError::Train(e.into()))
}
