//! Taking the locks of a checked request: the candidates, the shared GPU, the wait.

use std::time::Instant;

use tt_device::{Bytes, GpuBackend, Inventory, NvmlStatus};
use tt_lock::{GpuKey, GpuLock, Holder, LockDir, Wait};

use crate::error::Error;
use crate::options::{Request, ReserveOptions};
use crate::reservation::Waiting;

/// The GPUs of `inventory` that `CUDA_VISIBLE_DEVICES` (`visible`) leaves to this
/// process: an automatic choice must not lock a GPU the training could not use.
pub(crate) fn usable(inventory: &Inventory, visible: &tt_device::CudaVisibleDevices) -> Inventory {
    Inventory {
        gpus: inventory
            .visible(visible)
            .into_iter()
            .map(|v| v.gpu)
            .collect(),
        ..inventory.clone()
    }
}

/// The GPUs of `inventory` a Slurm job was allocated (by the node's indices, NVML's).
pub(crate) fn in_allocation(inventory: &Inventory, gpus: &tt_device::SlurmGpus) -> Inventory {
    Inventory {
        gpus: inventory
            .gpus
            .iter()
            .filter(|g| gpus.contains(g.nvml_index))
            .cloned()
            .collect(),
        ..inventory.clone()
    }
}

/// The Slurm job this process runs in and its GPUs, where Slurm allocated GPUs: the
/// outer bound of every GPU chosen here (by the node's indices). `None` outside Slurm
/// and in a job without GPUs; an error for a Slurm variable that is not Slurm's.
fn slurm_bound() -> Result<Option<(String, tt_device::SlurmGpus)>, Error> {
    let slurm = tt_device::SlurmJob::from_env().map_err(|e| Error::Options {
        reason: e.to_string(),
    })?;
    Ok(slurm.and_then(|job| job.gpus.map(|gpus| (job.id, gpus))))
}

/// Refuses each of `keys` (GPUs of `inventory`) that is not one of the Slurm job
/// `job`'s `gpus`, before anything is taken.
fn within(
    (job, gpus): (&str, &tt_device::SlurmGpus),
    inventory: &Inventory,
    keys: &[GpuKey],
) -> Result<(), Error> {
    for key in keys {
        let index = match key {
            GpuKey::Index(index) => Some(*index),
            GpuKey::Uuid(uuid) => inventory.gpu_of(uuid).map(|g| g.nvml_index),
        };
        if !index.is_some_and(|i| gpus.contains(i)) {
            return Err(Error::Options {
                reason: format!(
                    "{key} is not one of Slurm job {job}'s GPUs ({}): name one of those \
                     (the node's indices), or ask Slurm for more (`--gres=gpu:N`)",
                    gpus.said()
                ),
            });
        }
    }
    Ok(())
}

/// Inside a Slurm job, what a reservation checks, for a command that uses GPUs without
/// reserving them (`torchtools probe`): each of `keys` (GPUs of `inventory`) must be
/// one of the job's GPUs (else an [`Error::Options`] naming the job, its GPUs and the
/// variable read); returns the GPUs of `inventory` the job was allocated, to choose
/// from. Outside Slurm, or in a job without GPUs: `inventory` as it is.
pub fn within_slurm_job(inventory: &Inventory, keys: &[GpuKey]) -> Result<Inventory, Error> {
    match slurm_bound()? {
        None => Ok(inventory.clone()),
        Some((job, gpus)) => {
            within((&job, &gpus), inventory, keys)?;
            Ok(in_allocation(inventory, &gpus))
        }
    }
}

/// The locks a checked request took, and what was read on the way.
pub(crate) struct Taken {
    pub(crate) dir: LockDir,
    pub(crate) inventory: Inventory,
    /// A shared request's GPU and its memory.
    pub(crate) shared: Option<(GpuKey, Bytes)>,
    pub(crate) locks: Vec<GpuLock>,
}

/// Takes the locks `options` ask for (waiting as they say, `on_wait` told once), or
/// `None` when `auto` finds no GPU this process could use: nothing to reserve.
pub(crate) fn take_locks(
    machine: &dyn GpuBackend,
    options: &ReserveOptions,
    Request { auto, count }: Request,
    on_wait: impl FnOnce(&Waiting),
) -> Result<Option<Taken>, Error> {
    let inventory = machine.inventory();
    let no_gpu =
        !matches!(inventory.nvml, NvmlStatus::Available { .. }) || inventory.gpus.is_empty();
    // Inside a Slurm job, its GPUs are the outer bound (by the node's indices).
    let slurm = slurm_bound()?;
    let bound = slurm.as_ref().map(|(job, gpus)| (job.as_str(), gpus));
    // `auto` chooses among the GPUs this process may use.
    let candidates = match (auto, bound) {
        (false, _) => inventory.clone(),
        (true, Some((job, gpus))) => {
            tracing::info!("choosing among Slurm job {job}'s GPUs ({})", gpus.said());
            in_allocation(&inventory, gpus)
        }
        (true, None) => {
            let visible =
                tt_device::CudaVisibleDevices::from_env().map_err(|e| Error::Options {
                    reason: format!("CUDA_VISIBLE_DEVICES: {e}"),
                })?;
            usable(&inventory, &visible)
        }
    };
    if auto && (no_gpu || candidates.gpus.is_empty()) {
        let why = match bound {
            _ if no_gpu => "no GPU on this machine".to_owned(),
            Some((job, gpus)) => format!(
                "Slurm job {job} has none of this machine's GPUs ({})",
                gpus.said()
            ),
            None => "CUDA_VISIBLE_DEVICES hides every GPU".to_owned(),
        };
        tracing::info!("{why}: nothing to reserve");
        return Ok(None);
    }
    // Named GPUs resolve before anything is taken: a typo waits for nothing.
    let keys = if auto {
        Vec::new()
    } else {
        options
            .gpus
            .iter()
            .map(|spec| spec.resolve(&inventory))
            .collect::<tt_lock::Result<Vec<_>>>()?
    };
    if let Some(bound) = bound {
        within(bound, &inventory, &keys)?;
    }
    let dir = LockDir::from_env()?;
    let holder = options
        .holder
        .clone()
        .unwrap_or_else(|| Holder::current().reserving(options.training_reserved_bytes));
    let shared = match options.share {
        true => Some(share_target(
            &dir,
            &inventory,
            if auto { &candidates.gpus } else { &[] },
            &keys,
        )?),
        false => None,
    };
    let attempt = |wait: Wait| -> tt_lock::Result<Vec<GpuLock>> {
        if let Some((key, capacity)) = &shared {
            let bytes = options.training_reserved_bytes;
            dir.lock_shared(key, bytes, *capacity, wait, holder.clone())
                .map(|lock| vec![lock])
        } else if auto {
            dir.lock_auto(&candidates, count, wait, holder.clone())
        } else {
            dir.lock_many(&keys, wait, holder.clone())
        }
    };
    let start = Instant::now();
    let locks = match (options.blocking, attempt(Wait::Try)) {
        (true, Err(busy @ (tt_lock::Error::WouldBlock { .. } | tt_lock::Error::Held { .. }))) => {
            let (gpu, holder, held) = match busy {
                tt_lock::Error::WouldBlock { gpu, holder, .. } => (gpu, holder.map(|h| *h), None),
                // Held back by the policy: the first GPU asked for, and why.
                tt_lock::Error::Held { reason, .. } => (
                    keys.first().cloned().unwrap_or(GpuKey::Index(0)),
                    None,
                    Some(reason),
                ),
                _ => (GpuKey::Index(0), None, None),
            };
            on_wait(&Waiting {
                gpu,
                holder,
                timeout: options.timeout,
                held,
            });
            attempt(match options.timeout {
                Some(t) => Wait::Timeout(t.saturating_sub(start.elapsed())),
                None => Wait::Block,
            })?
        }
        (_, first) => first?,
    };
    Ok(Some(Taken {
        dir,
        inventory,
        shared,
        locks,
    }))
}

/// The GPU a shared reservation asks for, and its memory: the named GPU, or among
/// `candidates` (`auto`) the one with the most memory no sharer budgeted and nobody
/// holds alone (NVML's most free memory on ties).
fn share_target(
    dir: &LockDir,
    inventory: &Inventory,
    candidates: &[tt_device::GpuInfo],
    keys: &[GpuKey],
) -> Result<(GpuKey, Bytes), Error> {
    let capacity_of = |key: &GpuKey| match key {
        GpuKey::Uuid(uuid) => inventory.gpu_of(uuid).map(|g| g.total),
        GpuKey::Index(_) => None,
    };
    if let Some(key) = keys.first() {
        let capacity = capacity_of(key).ok_or_else(|| {
            Error::Options { reason: format!(
                "cannot share {key} by memory: its memory is unknown without NVML; reserve it whole instead"
            ) }
        })?;
        return Ok((key.clone(), capacity));
    }
    let states = dir.status(inventory)?;
    let room = |gpu: &tt_device::GpuInfo| {
        let key = GpuKey::of_uuid(&gpu.uuid);
        let state = states.iter().find(|s| s.gpu == key);
        let held = state.is_some_and(|s| s.held);
        let budgeted = state.map_or(0, |s| s.shared_bytes().0);
        (!held, gpu.total.0.saturating_sub(budgeted), gpu.free.0)
    };
    candidates
        .iter()
        .max_by_key(|g| room(g))
        .map(|g| (GpuKey::of_uuid(&g.uuid), g.total))
        .ok_or_else(|| Error::Options {
            reason: "no GPU to share on this machine".into(),
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a panic is how a test reports
    use super::*;
    use tt_device::{GpuInfo, NvmlStatus};

    fn gpu(index: u32) -> GpuInfo {
        GpuInfo {
            nvml_index: index,
            uuid: format!("GPU-00000000-0000-4000-8000-00000000000{index}"),
            name: "Test GPU".into(),
            total: Bytes::gib(80),
            free: Bytes::gib(80),
            used: Bytes(0),
            utilization: None,
            processes: Vec::new(),
            mig: Vec::new(),
        }
    }

    /// `auto` in a Slurm job chooses among the node's GPUs Slurm named, by NVML's index,
    /// whatever `CUDA_VISIBLE_DEVICES` says (relative to the job under device cgroups).
    #[test]
    fn a_slurm_jobs_gpus_are_its_node_indices() {
        let inventory = Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "test".into(),
            },
            gpus: (0..4).map(gpu).collect(),
            errors: Vec::new(),
        };
        let job = tt_device::SlurmJob::from_lookup(|name| match name {
            "SLURM_JOB_ID" => Some("9".into()),
            "SLURM_STEP_GPUS" => Some("2,3".into()),
            "CUDA_VISIBLE_DEVICES" => Some("0,1".into()),
            _ => None,
        })
        .unwrap()
        .unwrap();
        let chosen = in_allocation(&inventory, job.gpus.as_ref().unwrap());
        let indices: Vec<u32> = chosen.gpus.iter().map(|g| g.nvml_index).collect();
        assert_eq!(indices, [2, 3]);
    }
}
