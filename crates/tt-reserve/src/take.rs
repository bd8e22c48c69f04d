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
    // `auto` chooses among the GPUs this process may use.
    let candidates = if auto {
        let visible = tt_device::CudaVisibleDevices::from_env().map_err(|e| Error::Options {
            reason: format!("CUDA_VISIBLE_DEVICES: {e}"),
        })?;
        usable(&inventory, &visible)
    } else {
        inventory.clone()
    };
    if auto && (no_gpu || candidates.gpus.is_empty()) {
        let why = if no_gpu {
            "no GPU on this machine"
        } else {
            "CUDA_VISIBLE_DEVICES hides every GPU"
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
