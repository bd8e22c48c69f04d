#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod keeper;

use std::fmt;
use std::process::Command;
use std::time::{Duration, Instant};

use tt_device::{Bytes, CudaDriver, GpuBackend, Inventory, NvmlBackend, NvmlStatus};
use tt_fence::{Fence, FenceOptions, DEFAULT_SAFETY_MARGIN};
use tt_lock::{GpuKey, GpuLock, GpuSpec, Holder, LockDir, Wait};

/// What to reserve, and how long to wait. The fields and defaults follow the Python
/// torchtools' `reserve_gpu_for_training(gpu=None, training_reserved_bytes=0,
/// safety_margin_bytes=50 MiB, blocking=True, timeout=None, fence=True)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveOptions {
    /// Which GPUs: NVML indices, UUIDs, `cuda:N` of this process, or one
    /// [`GpuSpec::Auto`] (default: the free GPU(s) with the most free memory).
    pub gpus: Vec<GpuSpec>,
    /// How many GPUs `Auto` takes (`None`: 1). With named GPUs it may only repeat
    /// their number.
    pub count: Option<usize>,
    /// Memory the training job needs: the fence leaves this much free.
    pub training_reserved_bytes: Bytes,
    /// Left free on top of `training_reserved_bytes` (default 50 MiB, as in Python).
    pub safety_margin_bytes: Bytes,
    /// Wait for a GPU someone else holds (default); `false` fails at once.
    pub blocking: bool,
    /// With `blocking`, give up after this long (default: wait as long as it takes).
    pub timeout: Option<Duration>,
    /// Raise a memory fence (default); `false` takes the lock alone.
    pub fence: bool,
    /// The holder record every user sees (default: this process, with
    /// `training_reserved_bytes` as the reserved bytes).
    pub holder: Option<Holder>,
    /// Share one GPU with other jobs by memory budget instead of taking it alone:
    /// `training_reserved_bytes` is the budget, granted when it fits beside the other
    /// sharers' within the GPU's memory (in the same first-come-first-served queue; see
    /// [`LockDir::lock_shared`]). With `fence`, the memory no sharer budgeted (or
    /// budgeted and took) is fenced, by the oldest sharer's reservation, following the
    /// sharers as they come and go; the command it prepares gets PyTorch's allocator
    /// capped at the budget (`PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F`).
    /// Default `false`.
    pub share: bool,
}

impl Default for ReserveOptions {
    fn default() -> Self {
        ReserveOptions {
            gpus: vec![GpuSpec::Auto],
            count: None,
            training_reserved_bytes: Bytes(0),
            safety_margin_bytes: DEFAULT_SAFETY_MARGIN,
            blocking: true,
            timeout: None,
            fence: true,
            holder: None,
            share: false,
        }
    }
}

impl ReserveOptions {
    /// The defaults on one named GPU (`"3"`, a UUID, `"cuda:1"`, or `Auto`).
    pub fn on(gpu: GpuSpec) -> Self {
        ReserveOptions {
            gpus: vec![gpu],
            ..ReserveOptions::default()
        }
    }
}

/// Why a reservation failed, or why a held one cannot do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Taking the GPU lock failed (busy past the timeout, bad GPU, lock directory).
    #[error("reserving a GPU: {0}")]
    Lock(tt_lock::Error),
    /// Raising the memory fence failed; the locks were released.
    #[error("reserving a GPU: {0}")]
    Fence(tt_fence::Error),
    /// The options contradict each other; nothing was taken.
    #[error("reserving a GPU: {0}")]
    Options(String),
    /// The fence needs to know which physical GPU to fence.
    #[error(
        "reserving a GPU: cannot fence {gpu}: without NVML the GPU's identity is unknown; \
         reserve with the lock alone (fence: false, or `torchtools reserve --no-fence`)"
    )]
    FenceWithoutNvml {
        /// The GPU locked.
        gpu: GpuKey,
    },
    /// A GPU is reserved but this process's CUDA driver does not show it (no driver,
    /// `CUDA_VISIBLE_DEVICES` hides it, or only its index lock is held): training on
    /// the CPU instead would silently give up the GPU that was waited for.
    #[error(
        "the reserved GPU {gpu} is not visible to CUDA in this process (no CUDA driver, \
         CUDA_VISIBLE_DEVICES hides it, or it is split into MIG instances, which CUDA names \
         by their own UUIDs and torchtools does not reserve yet); run where the driver sees \
         it, or reserve with `gpus: vec![GpuSpec::Auto]` to train on the CPU when the \
         machine has no GPU"
    )]
    NoCudaDevice {
        /// The GPU reserved.
        gpu: GpuKey,
    },
}

// The inner error is in the message; it is not also the `source()`, so that a chain
// printer (`{e:#}`) says it once.
impl From<tt_lock::Error> for Error {
    fn from(e: tt_lock::Error) -> Error {
        Error::Lock(e)
    }
}

impl From<tt_fence::Error> for Error {
    fn from(e: tt_fence::Error) -> Error {
        Error::Fence(e)
    }
}

impl Error {
    /// Whether it failed because the GPUs stayed held by someone else (past the timeout,
    /// or at once with `blocking: false`): try later, not a mistake in the request.
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            Error::Lock(tt_lock::Error::Timeout { .. } | tt_lock::Error::WouldBlock { .. })
        )
    }

    /// Whether the request itself is wrong (an unknown or malformed GPU, contradicting
    /// options): fix the arguments.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            Error::Options(_)
                | Error::Lock(
                    tt_lock::Error::InvalidGpu { .. } | tt_lock::Error::UnknownGpu { .. }
                )
        )
    }
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

/// The GPU a reservation waits for, passed to [`reserve_with`]'s observer.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// The GPU someone else holds.
    pub gpu: GpuKey,
    /// Their record, when they left one.
    pub holder: Option<Holder>,
    /// How long it will wait at most (`None`: as long as it takes).
    pub timeout: Option<Duration>,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is locked by ", self.gpu)?;
        match &self.holder {
            Some(h) => write!(f, "{h}")?,
            None => f.write_str("a process that left no record")?,
        }
        f.write_str("; waiting")?;
        if let Some(t) = self.timeout {
            write!(f, " (at most {t:?})")?;
        }
        Ok(())
    }
}

/// A held reservation: the locks and fences, released on drop (fences first).
///
/// On a machine without GPUs, `Auto` gives an empty reservation
/// ([`Reservation::is_empty`]): the same training code then runs on the CPU with no
/// special case. Naming a GPU there reserves its index lock with `fence: false` (what
/// scripts that only serialise jobs need), and is an error with a fence.
#[derive(Debug)]
#[must_use = "the GPUs are released when the reservation is dropped"]
pub struct Reservation {
    // Field order is drop order: fences go back to the driver before the locks go.
    /// A shared GPU's fence keeper (its thread stops and lowers its fence on drop).
    keeper: Option<keeper::Keeper>,
    fences: Vec<Fence>,
    locks: Vec<GpuLock>,
    gpus: Vec<ReservedGpu>,
    /// A shared reservation's budget as a fraction of its GPU's memory.
    share_fraction: Option<f64>,
}

/// The GPUs of `inventory` that `CUDA_VISIBLE_DEVICES` (`visible`) leaves to this
/// process: an automatic choice must not lock a GPU the training could not use.
fn usable(inventory: &Inventory, visible: &tt_device::CudaVisibleDevices) -> Inventory {
    Inventory {
        gpus: inventory
            .visible(visible)
            .into_iter()
            .map(|v| v.gpu)
            .collect(),
        ..inventory.clone()
    }
}

/// Reserves GPU(s) for a training job: takes the lock of each (waiting as `options`
/// say), then raises a fence leaving `training_reserved_bytes + safety_margin_bytes`
/// free for the job. Hold the returned [`Reservation`] while training. Waiting for a
/// GPU someone else holds is logged (`tracing`, level info); [`reserve_with`] lets you
/// show it yourself.
pub fn reserve(options: ReserveOptions) -> Result<Reservation, Error> {
    reserve_with(options, |w| tracing::info!("{w}"))
}

/// [`reserve`], calling `on_wait` once when a GPU is held by someone else and the
/// options say to wait.
pub fn reserve_with(
    options: ReserveOptions,
    on_wait: impl FnOnce(&Waiting),
) -> Result<Reservation, Error> {
    reserve_on(&NvmlBackend::open(), options, on_wait)
}

/// [`reserve_with`] on the GPUs `machine` lists (NVML's through [`NvmlBackend`] in
/// [`reserve`]; another backend, such as a fixed inventory, chooses among its GPUs).
pub fn reserve_on(
    machine: &dyn GpuBackend,
    options: ReserveOptions,
    on_wait: impl FnOnce(&Waiting),
) -> Result<Reservation, Error> {
    let auto = options.gpus.contains(&GpuSpec::Auto);
    if options.gpus.is_empty() {
        return Err(Error::Options(
            "no GPU named: give one or more, or GpuSpec::Auto".into(),
        ));
    }
    if auto && options.gpus.len() > 1 {
        return Err(Error::Options(
            "auto cannot be combined with named GPUs".into(),
        ));
    }
    let count = match options.count {
        Some(0) => {
            return Err(Error::Options(
                "a count of 0 reserves nothing: ask for 1 or more".into(),
            ))
        }
        Some(n) if !auto && n != options.gpus.len() => {
            return Err(Error::Options(format!(
                "a count of {n} but {} GPU(s) named: give a count only with auto",
                options.gpus.len()
            )))
        }
        Some(n) => n,
        None => 1,
    };
    // A shared request's own mistakes, before anything is looked at.
    if options.share && (count != 1 || options.gpus.len() != 1) {
        return Err(Error::Options(
            "a shared reservation takes one GPU: name one, or auto with a count of 1".into(),
        ));
    }
    if options.share && options.training_reserved_bytes.0 == 0 {
        return Err(Error::Options(
            "a shared reservation needs its budget, the bytes the job needs: --share --bytes \
             20GiB, or --bytes auto to measure it with a probe run (the API: \
             training_reserved_bytes); sharers are admitted while their budgets fit in the \
             GPU's memory"
                .into(),
        ));
    }
    let inventory = machine.inventory();
    let no_gpu =
        !matches!(inventory.nvml, NvmlStatus::Available { .. }) || inventory.gpus.is_empty();
    // `auto` chooses among the GPUs this process may use.
    let candidates = if auto {
        let visible = tt_device::CudaVisibleDevices::from_env()
            .map_err(|e| Error::Options(format!("CUDA_VISIBLE_DEVICES: {e}")))?;
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
        return Ok(Reservation {
            fences: Vec::new(),
            locks: Vec::new(),
            gpus: Vec::new(),
            share_fraction: None,
            keeper: None,
        });
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
        (true, Err(tt_lock::Error::WouldBlock { gpu, holder, .. })) => {
            on_wait(&Waiting {
                gpu,
                holder: holder.map(|h| *h),
                timeout: options.timeout,
            });
            attempt(match options.timeout {
                Some(t) => Wait::Timeout(t.saturating_sub(start.elapsed())),
                None => Wait::Block,
            })?
        }
        (_, first) => first?,
    };
    // CUDA's devices by the driver's UUIDs: a locked GPU's ordinal is the first device
    // that is that GPU, or one of its MIG instances.
    let cuda_uuids = CudaDriver::init().and_then(|d| d.uuids()).ok();
    let mut reservation = Reservation {
        fences: Vec::new(),
        gpus: locks
            .iter()
            .map(|lock| ReservedGpu {
                key: lock.key().clone(),
                ordinal: match (lock.key(), &cuda_uuids) {
                    (GpuKey::Uuid(uuid), Some(uuids)) => inventory.cuda_ordinal_of(uuid, uuids),
                    _ => None,
                },
                fenced: Bytes(0),
            })
            .collect(),
        locks,
        share_fraction: shared
            .as_ref()
            .map(|(_, capacity)| options.training_reserved_bytes.0 as f64 / capacity.0 as f64),
        keeper: None,
    };
    if let (true, Some((GpuKey::Uuid(uuid), _)), Some(gpu), Some(lock)) = (
        options.fence,
        &shared,
        reservation.gpus.first(),
        reservation.locks.first(),
    ) {
        // The fence of a shared GPU follows the ledger (see `keeper`); this job's
        // budget is freed for it before its command starts.
        reservation.keeper = Some(keeper::Keeper::start(
            dir.clone(),
            keeper::Target {
                key: gpu.key.clone(),
                uuid: uuid.clone(),
                ordinal: gpu.ordinal,
                margin: options.safety_margin_bytes,
            },
            lock.holder().clone(),
        ));
        let room = Bytes(options.training_reserved_bytes.0 + options.safety_margin_bytes.0);
        if !keeper::wait_for_room(machine, uuid, room) {
            tracing::warn!(
                "{room} not free on {uuid} after {:?} (memory used outside the sharers' \
                 budgets): starting anyway",
                keeper::ADMISSION_WAIT
            );
        }
    }
    if options.fence && !options.share {
        let fence_options = FenceOptions {
            safety_margin: options.safety_margin_bytes,
            ..FenceOptions::keep_free(options.training_reserved_bytes)
        };
        for gpu in &mut reservation.gpus {
            let GpuKey::Uuid(uuid) = &gpu.key else {
                return Err(Error::FenceWithoutNvml {
                    gpu: gpu.key.clone(),
                });
            };
            // On error the reservation so far is dropped: fences lowered, locks released.
            // By ordinal where known: a GPU in MIG mode is reached through its instance.
            let fence = match gpu.ordinal {
                Some(ordinal) => Fence::raise(ordinal, &fence_options)?,
                None => Fence::raise_on_uuid(uuid, &fence_options)?,
            };
            gpu.fenced = fence.fenced();
            reservation.fences.push(fence);
        }
        reservation.record_fences();
    }
    Ok(reservation)
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
            Error::Options(format!(
                "cannot share {key} by memory: its memory is unknown without NVML; reserve it whole instead"
            ))
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
        .ok_or_else(|| Error::Options("no GPU to share on this machine".into()))
}

/// The variable through which a shared reservation tells its command its budget as a
/// fraction of the GPU's memory (for `torch.cuda.set_per_process_memory_fraction`).
pub const SHARE_FRACTION_ENV: &str = "TORCHTOOLS_SHARE_FRACTION";

/// `PYTORCH_CUDA_ALLOC_CONF` with `per_process_memory_fraction` set to `fraction`
/// (PyTorch's allocator refuses to grow past that share of the GPU's memory), the
/// other options of `current` kept.
fn alloc_conf_with_fraction(current: Option<&str>, fraction: f64) -> String {
    let mut parts: Vec<String> = current
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with("per_process_memory_fraction"))
        .map(str::to_owned)
        .collect();
    parts.push(format!(
        "per_process_memory_fraction:{:.6}",
        fraction.clamp(0.0, 1.0)
    ));
    parts.join(",")
}

impl Reservation {
    /// The reserved GPUs, in lock order.
    pub fn gpus(&self) -> &[ReservedGpu] {
        &self.gpus
    }

    /// The exit status of the job that used the GPUs (128 + a signal's number when it
    /// was killed), for the records of the lock directory's usage log (`torchtools
    /// usage`).
    pub fn set_exit_status(&mut self, status: i32) {
        for lock in &mut self.locks {
            lock.set_exit_status(status);
        }
    }

    /// The held locks (their files and holder records).
    pub fn locks(&self) -> &[GpuLock] {
        &self.locks
    }

    /// The raised fences, one per reserved GPU (none with `fence: false`).
    pub fn fences(&self) -> &[Fence] {
        &self.fences
    }

    /// Whether nothing was reserved (`Auto` on a machine without GPUs).
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// `cuda:N` of the first reserved GPU in this process, when the CUDA driver sees it.
    pub fn ordinal(&self) -> Option<usize> {
        self.gpus.first().and_then(|g| g.ordinal)
    }

    /// The device to train on: the first reserved GPU as `cuda:N`, or the CPU when
    /// nothing was reserved because the machine has no GPU. A GPU that is reserved but
    /// not visible to CUDA here is [`Error::NoCudaDevice`], never the CPU.
    #[cfg(feature = "tch")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
    pub fn device(&self) -> Result<tch::Device, Error> {
        match self.gpus.first() {
            None => Ok(tch::Device::Cpu),
            Some(ReservedGpu {
                ordinal: Some(n), ..
            }) => Ok(tch::Device::Cuda(*n)),
            Some(gpu) => Err(Error::NoCudaDevice {
                gpu: gpu.key.clone(),
            }),
        }
    }

    /// `CUDA_VISIBLE_DEVICES` for a child that should see exactly the reserved GPUs
    /// (UUIDs, or indices without NVML); empty when nothing was reserved.
    pub fn cuda_visible_devices(&self) -> String {
        self.gpus
            .iter()
            .map(|g| g.key.cuda_visible_entry())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Prepares `command` to run on the reservation: `CUDA_VISIBLE_DEVICES` set to the
    /// reserved GPUs (when any), and the lock descriptors inherited, so that torchtools
    /// inside the child takes them over instead of waiting for its own parent.
    ///
    /// A shared reservation also caps the command's PyTorch (or libtorch) allocator at
    /// its budget: `per_process_memory_fraction` added to `PYTORCH_CUDA_ALLOC_CONF`
    /// (an option of recent PyTorch: checked with 2.11), and says the fraction in
    /// [`SHARE_FRACTION_ENV`].
    pub fn prepare(&self, command: &mut Command) {
        self.prepare_with(command, true);
    }

    /// [`Reservation::prepare`], with `cap_allocator` false leaving
    /// `PYTORCH_CUDA_ALLOC_CONF` as it is (for a PyTorch too old to know
    /// `per_process_memory_fraction`, which it refuses): the command then reads its
    /// share from [`SHARE_FRACTION_ENV`] (`torchtools reserve --share --no-cap`).
    pub fn prepare_with(&self, command: &mut Command, cap_allocator: bool) {
        if !self.gpus.is_empty() {
            command.env("CUDA_VISIBLE_DEVICES", self.cuda_visible_devices());
        }
        if let Some(fraction) = self.share_fraction {
            command.env(SHARE_FRACTION_ENV, format!("{fraction:.6}"));
            if cap_allocator {
                let current = std::env::var("PYTORCH_CUDA_ALLOC_CONF").ok();
                command.env(
                    "PYTORCH_CUDA_ALLOC_CONF",
                    alloc_conf_with_fraction(current.as_deref(), fraction),
                );
            }
        }
        tt_lock::share_with(command, &self.locks);
    }

    /// Records `pid` as the command running on the reservation, in every lock's holder
    /// record (what `torchtools locks` shows).
    pub fn record_command_pid(&mut self, pid: u32) -> Result<(), Error> {
        for lock in &mut self.locks {
            let mut record = lock.holder().clone();
            record.command_pid = Some(pid);
            lock.set_holder(record)?;
        }
        Ok(())
    }

    /// Writes each GPU's fenced bytes into its lock's holder record (what `torchtools
    /// locks` and `top` show); a failure to write only loses that display.
    fn record_fences(&mut self) {
        for lock in &mut self.locks {
            let Some(gpu) = self.gpus.iter().find(|g| &g.key == lock.key()) else {
                continue;
            };
            let mut record = lock.holder().clone();
            record.fenced = Some(gpu.fenced);
            if let Err(e) = lock.set_holder(record) {
                tracing::warn!("cannot record the fence in {}: {e}", lock.path().display());
            }
        }
    }

    /// What the fences hold in all.
    pub fn fenced(&self) -> Bytes {
        Bytes(self.fences.iter().map(|f| f.fenced().0).sum())
    }

    /// Hands at least `bytes` of fence memory back (to the driver, where this process's
    /// libtorch allocator can take it at once), from the first fence that holds any;
    /// returns what was freed.
    pub fn release_fence(&mut self, bytes: Bytes) -> Result<Bytes, Error> {
        let mut freed = 0u64;
        for (fence, gpu) in self.fences.iter_mut().zip(self.gpus.iter_mut()) {
            if freed >= bytes.0 {
                break;
            }
            freed += fence.shrink(Bytes(bytes.0 - freed))?.0;
            gpu.fenced = fence.fenced();
        }
        self.record_fences();
        Ok(Bytes(freed))
    }

    /// Lowers every fence, keeping the locks; returns what was freed.
    pub fn lower_fences(&mut self) -> Result<Bytes, Error> {
        let mut freed = 0;
        for (fence, gpu) in self.fences.iter_mut().zip(self.gpus.iter_mut()) {
            freed += fence.lower()?.0;
            gpu.fenced = Bytes(0);
        }
        self.record_fences();
        Ok(Bytes(freed))
    }
}

/// tt-adaptive's OOM hook backed by a reservation's fence: on an out-of-memory, hand
/// `step` of fence memory back (to the driver, where libtorch's allocator takes it) and
/// retry the same size before lowering it; `false` once the fence is empty.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tt_device::Bytes;
/// use tt_reserve::{fence_release_hook, reserve, ReserveOptions};
///
/// let reservation = Arc::new(Mutex::new(reserve(ReserveOptions::default())?));
/// let adaptive = tt_adaptive::Adaptive::new()
///     .on_oom(fence_release_hook(Arc::clone(&reservation), Bytes::gib(1)));
/// # drop(adaptive);
/// # Ok::<(), tt_reserve::Error>(())
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

#[cfg(test)]
mod tests {
    use super::{alloc_conf_with_fraction, usable};
    use tt_device::{Bytes, GpuInfo, Inventory, NvmlStatus};

    #[test]
    fn auto_chooses_among_the_gpus_cuda_visible_devices_leaves() {
        let gpu = |i: u32, free: u64| GpuInfo {
            nvml_index: i,
            uuid: format!("GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-000000000000"),
            name: "NVIDIA H100".into(),
            total: Bytes::gib(80),
            free: Bytes::gib(free),
            used: Bytes::gib(80 - free),
            utilization: None,
            processes: vec![],
            mig: vec![],
        };
        let machine = Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "580.00".into(),
            },
            gpus: vec![gpu(0, 70), gpu(1, 10), gpu(2, 40)],
            errors: vec![],
        };
        let indices = |v: Option<&str>| -> Vec<u32> {
            let visible = match v {
                None => tt_device::CudaVisibleDevices::Unset,
                Some(v) => tt_device::CudaVisibleDevices::parse(v).unwrap(),
            };
            usable(&machine, &visible)
                .gpus
                .iter()
                .map(|g| g.nvml_index)
                .collect()
        };
        assert_eq!(indices(None), [0, 1, 2]);
        // GPU 0 has the most free memory, but this process may not use it.
        assert_eq!(indices(Some("1,2")), [1, 2]);
        assert_eq!(indices(Some("GPU-2222")), [2]);
        assert_eq!(indices(Some("")), Vec::<u32>::new());
    }

    #[test]
    fn a_share_caps_pytorchs_allocator_and_keeps_the_users_other_options() {
        assert_eq!(
            alloc_conf_with_fraction(None, 0.25),
            "per_process_memory_fraction:0.250000"
        );
        assert_eq!(
            alloc_conf_with_fraction(
                Some("expandable_segments:True, per_process_memory_fraction:0.9"),
                0.5
            ),
            "expandable_segments:True,per_process_memory_fraction:0.500000"
        );
    }
}
