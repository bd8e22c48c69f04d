//! `torchtools.slurm`'s reading of the Slurm job a Python process runs in, and its
//! requeue: tt-device's, so that Python and the `torchtools` command agree on the job's
//! id (an array task's), its GPUs and who requeues it.

use pyo3::prelude::*;
use tt_device::{SelfRequeue, SlurmJob};

/// A Slurm job as Python gets it: its id, its GPUs' indices, the variable they came from.
type Job = (String, Option<Vec<u32>>, Option<&'static str>);

/// The Slurm job of this process: `(id, gpu indices, the variable they came from)`, the
/// GPUs `None` when Slurm allocated none; `None` outside Slurm. A variable that does
/// not hold what Slurm writes is a `BadRequestError` naming it.
#[pyfunction]
pub(crate) fn slurm_job() -> PyResult<Option<Job>> {
    let job =
        SlurmJob::from_env().map_err(|e| crate::errors::BadRequestError::new_err(e.to_string()))?;
    Ok(job.map(|job| {
        let (indices, from) = match job.gpus {
            Some(gpus) => (Some(gpus.indices), Some(gpus.from)),
            None => (None, None),
        };
        (job.id, indices, from)
    }))
}

/// How many times Slurm requeued this process's job (`SLURM_RESTART_COUNT`; 0 on its
/// first run and outside Slurm).
#[pyfunction]
pub(crate) fn slurm_restart_count() -> u32 {
    tt_device::slurm_restart_count()
}

/// Requeues this process's Slurm job when it is the one to (see
/// `tt_device::slurm_requeue_self_saying`), saying so on standard error first. Returns
/// who requeues it (`"requeued"`, `"torchtools"`, `"rank zero"`, or `"not in slurm"`)
/// and the job's id; a `TorchtoolsError` saying why it could not.
#[pyfunction]
pub(crate) fn slurm_requeue_self(py: Python<'_>) -> PyResult<(&'static str, Option<String>)> {
    let done = py
        .detach(|| {
            tt_device::slurm_requeue_self_saying(|job| {
                eprintln!("torchtools: {}", tt_device::slurm_requeuing_said(job));
            })
        })
        .map_err(crate::errors::error)?;
    Ok(match done {
        SelfRequeue::NotInSlurm => ("not in slurm", None),
        SelfRequeue::ByTorchtools(job) => ("torchtools", Some(job)),
        SelfRequeue::ByRankZero(job) => ("rank zero", Some(job)),
        SelfRequeue::Requeued(job) => ("requeued", Some(job)),
    })
}
