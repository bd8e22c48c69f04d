//! `reserve_gpu_for_training`: the lock and the fence together, as the seed's context
//! manager of the same name, without its defects (a timeout that never fired, locks
//! keyed by the logical index, no owner record, fence memory kept in a cache).

use std::time::Duration;

use tt_device::{Bytes, CudaDriver, Inventory, NvmlStatus};
use tt_fence::{Fence, FenceOptions, DEFAULT_SAFETY_MARGIN};
use tt_lock::{GpuKey, GpuLock, GpuSpec, Holder, LockDir, Wait};

/// What to reserve, and how long to wait. The fields and defaults follow the seed's
/// `reserve_gpu_for_training(gpu=None, training_reserved_bytes=0,
/// safety_margin_bytes=50 MiB, blocking=True, timeout=None, fence=True)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveOptions {
    /// Which GPU: an NVML index, a UUID, `cuda:N` of this process, or
    /// [`GpuSpec::Auto`] (default: the free GPU with the most free memory).
    pub gpu: GpuSpec,
    /// How many GPUs `Auto` takes (default 1); ignored otherwise.
    pub count: usize,
    /// Memory the training job needs: the fence leaves this much free.
    pub training_reserved_bytes: Bytes,
    /// Left free on top of `training_reserved_bytes` (default 50 MiB, like the seed).
    pub safety_margin_bytes: Bytes,
    /// Wait for a GPU someone else holds (default); `false` fails at once.
    pub blocking: bool,
    /// With `blocking`, give up after this long (default: wait as long as it takes).
    pub timeout: Option<Duration>,
    /// Raise a memory fence (default); `false` takes the lock alone.
    pub fence: bool,
}

impl Default for ReserveOptions {
    fn default() -> Self {
        ReserveOptions {
            gpu: GpuSpec::Auto,
            count: 1,
            training_reserved_bytes: Bytes(0),
            safety_margin_bytes: DEFAULT_SAFETY_MARGIN,
            blocking: true,
            timeout: None,
            fence: true,
        }
    }
}

/// Why a reservation failed, by stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReserveError {
    /// Taking the GPU lock failed (busy past the timeout, bad GPU, lock directory).
    #[error("reserving a GPU: {0}")]
    Lock(#[from] tt_lock::Error),
    /// Raising the memory fence failed; the lock was released.
    #[error("reserving a GPU: {0}")]
    Fence(#[from] tt_fence::Error),
    /// The fence needs to know which physical GPU to fence.
    #[error(
        "reserving a GPU: cannot fence {gpu}: without NVML the GPU's identity is unknown; \
         set fence: false to reserve with the lock alone"
    )]
    FenceWithoutNvml {
        /// The GPU locked.
        gpu: GpuKey,
    },
}

/// One reserved GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedGpu {
    /// Its lock key: the UUID, or the index without NVML.
    pub key: GpuKey,
    /// `cuda:N` in this process, when the CUDA driver sees it.
    pub ordinal: Option<usize>,
    /// What the fence holds on it.
    pub fenced: Bytes,
}

/// A held reservation: the locks and fences, released on drop (fences first).
///
/// On a machine without GPUs, `gpu: Auto` gives an empty reservation
/// ([`Reservation::is_empty`]): the same training code then runs on the CPU with no
/// special case. Naming a GPU there reserves it by index with `fence: false`, and is an
/// error with a fence.
#[derive(Debug)]
pub struct Reservation {
    // Field order is drop order: fences go back to the driver before the locks go.
    fences: Vec<Fence>,
    locks: Vec<GpuLock>,
    gpus: Vec<ReservedGpu>,
}

/// Reserves GPU(s) for a training job: takes the lock of each (waiting as `options`
/// say), then raises a fence leaving `training_reserved_bytes + safety_margin_bytes`
/// free for the job. Hold the returned [`Reservation`] while training.
///
/// ```
/// use torchtools::{reserve_gpu_for_training, ReserveOptions};
/// use torchtools::device::Bytes;
///
/// let reservation = reserve_gpu_for_training(ReserveOptions {
///     training_reserved_bytes: Bytes::gib(6),
///     ..ReserveOptions::default()
/// })?;
/// // On this CPU-only machine the reservation is empty; on a GPU machine it holds
/// // the lock of the free GPU with the most memory and a fence leaving 6 GiB free.
/// println!("reserved {:?}", reservation.gpus());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn reserve_gpu_for_training(options: ReserveOptions) -> Result<Reservation, ReserveError> {
    let inventory = Inventory::query();
    let no_gpu =
        !matches!(inventory.nvml, NvmlStatus::Available { .. }) || inventory.gpus.is_empty();
    if options.gpu == GpuSpec::Auto && no_gpu {
        tracing::info!("no GPU on this machine: nothing to reserve");
        return Ok(Reservation {
            fences: Vec::new(),
            locks: Vec::new(),
            gpus: Vec::new(),
        });
    }
    let wait = match (options.blocking, options.timeout) {
        (false, _) => Wait::Try,
        (true, Some(t)) => Wait::Timeout(t),
        (true, None) => Wait::Block,
    };
    let dir = LockDir::from_env()?;
    let holder = Holder::current().reserving(options.training_reserved_bytes);
    let locks = match &options.gpu {
        GpuSpec::Auto => dir.lock_auto(&inventory, options.count.max(1), wait, holder)?,
        spec => {
            let key = spec.resolve(&inventory)?;
            vec![dir.lock(&key, wait, holder)?]
        }
    };
    let driver = CudaDriver::init().ok();
    let mut reservation = Reservation {
        fences: Vec::new(),
        gpus: locks
            .iter()
            .map(|lock| ReservedGpu {
                key: lock.key().clone(),
                ordinal: match (lock.key(), &driver) {
                    (GpuKey::Uuid(uuid), Some(d)) => d.ordinal_of(uuid).ok().flatten(),
                    _ => None,
                },
                fenced: Bytes(0),
            })
            .collect(),
        locks,
    };
    if options.fence {
        let fence_options = FenceOptions {
            safety_margin: options.safety_margin_bytes,
            ..FenceOptions::keep_free(options.training_reserved_bytes)
        };
        for gpu in &mut reservation.gpus {
            let GpuKey::Uuid(uuid) = &gpu.key else {
                return Err(ReserveError::FenceWithoutNvml {
                    gpu: gpu.key.clone(),
                });
            };
            // On error the reservation so far is dropped: fences lowered, locks released.
            let fence = Fence::raise_on_uuid(uuid, &fence_options)?;
            gpu.fenced = fence.fenced();
            reservation.fences.push(fence);
        }
    }
    Ok(reservation)
}

impl Reservation {
    /// The reserved GPUs, in lock order.
    pub fn gpus(&self) -> &[ReservedGpu] {
        &self.gpus
    }

    /// The held locks (their files and holder records).
    pub fn locks(&self) -> &[GpuLock] {
        &self.locks
    }

    /// Whether nothing was reserved (`gpu: Auto` on a machine without GPUs).
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// `cuda:N` of the first reserved GPU in this process: the device to train on.
    pub fn ordinal(&self) -> Option<usize> {
        self.gpus.first().and_then(|g| g.ordinal)
    }

    /// The first reserved GPU as a `tch::Device` (CPU when the reservation is empty).
    #[cfg(feature = "tch")]
    pub fn device(&self) -> tch::Device {
        match self.ordinal() {
            Some(n) => tch::Device::Cuda(n),
            None => tch::Device::Cpu,
        }
    }

    /// What the fences hold in all.
    pub fn fenced(&self) -> Bytes {
        Bytes(self.fences.iter().map(|f| f.fenced().0).sum())
    }

    /// Hands at least `bytes` of fence memory back (to the driver, where this process's
    /// libtorch allocator can take it at once), from the first fence that holds any;
    /// returns what was freed. This is the hook tt-adaptive calls before it lowers a
    /// batch size.
    pub fn release_fence(&mut self, bytes: Bytes) -> Result<Bytes, ReserveError> {
        let mut freed = 0u64;
        for (fence, gpu) in self.fences.iter_mut().zip(self.gpus.iter_mut()) {
            if freed >= bytes.0 {
                break;
            }
            freed += fence.shrink(Bytes(bytes.0 - freed))?.0;
            gpu.fenced = fence.fenced();
        }
        Ok(Bytes(freed))
    }

    /// Lowers every fence, keeping the locks; returns what was freed.
    pub fn lower_fences(&mut self) -> Result<Bytes, ReserveError> {
        let mut freed = 0;
        for (fence, gpu) in self.fences.iter_mut().zip(self.gpus.iter_mut()) {
            freed += fence.lower()?.0;
            gpu.fenced = Bytes(0);
        }
        Ok(Bytes(freed))
    }
}

/// tt-adaptive's OOM hook backed by a reservation's fence: on an out-of-memory, hand
/// `step` of fence memory back (to the driver, where libtorch's allocator takes it) and
/// retry the same size before lowering it; `false` once the fence is empty.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use torchtools::device::Bytes;
/// use torchtools::{fence_release_hook, reserve_gpu_for_training, ReserveOptions};
///
/// let reservation = Arc::new(Mutex::new(reserve_gpu_for_training(ReserveOptions::default())?));
/// let adaptive = torchtools::adaptive::Adaptive::new()
///     .on_oom(fence_release_hook(Arc::clone(&reservation), Bytes::gib(1)));
/// # drop(adaptive);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn fence_release_hook(
    reservation: std::sync::Arc<std::sync::Mutex<Reservation>>,
    step: Bytes,
) -> impl Fn(tt_adaptive::OomKind, usize) -> bool + Send + Sync + 'static {
    move |kind, size| {
        let Ok(mut r) = reservation.lock() else {
            return false;
        };
        match r.release_fence(step) {
            Ok(freed) if freed.0 > 0 => {
                tracing::info!(%kind, size, %freed, "out of memory: released fence memory, retrying");
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::warn!("releasing fence memory after an OOM: {e}");
                false
            }
        }
    }
}
