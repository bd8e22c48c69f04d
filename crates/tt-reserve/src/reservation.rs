//! A held reservation: its GPUs, locks and fences, and what it prepares a command with.

use std::fmt;
use std::process::Command;
use std::time::Duration;

use tt_device::Bytes;
use tt_fence::Fence;
use tt_lock::{GpuKey, GpuLock, Holder};

use crate::error::Error;
use crate::keeper;

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

/// The GPU a reservation waits for, passed to [`reserve_with`](crate::reserve_with)'s observer.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// The GPU someone else holds.
    pub gpu: GpuKey,
    /// Their record, when they left one.
    pub holder: Option<Holder>,
    /// How long it will wait at most (`None`: as long as it takes).
    pub timeout: Option<Duration>,
    /// Why the machine's policy holds the request back, when it does (a per-user
    /// limit reached: `held by policy: 2 of 2 GPU(s) held, 1 more asked`); the GPU may
    /// be free then.
    pub held: Option<String>,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.held, &self.holder) {
            (Some(why), _) => write!(f, "{why}")?,
            (None, Some(h)) => write!(f, "{} is locked by {h}", self.gpu)?,
            (None, None) => write!(f, "{} is locked by a process that left no record", self.gpu)?,
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
    pub(crate) keeper: Option<keeper::Keeper>,
    pub(crate) fences: Vec<Fence>,
    pub(crate) locks: Vec<GpuLock>,
    pub(crate) gpus: Vec<ReservedGpu>,
    /// A shared reservation's budget as a fraction of its GPU's memory.
    share_fraction: Option<f64>,
}

/// The variable through which a shared reservation tells its command its budget as a
/// fraction of the GPU's memory (for `torch.cuda.set_per_process_memory_fraction`).
pub const SHARE_FRACTION_ENV: &str = "TORCHTOOLS_SHARE_FRACTION";

/// `PYTORCH_CUDA_ALLOC_CONF` with `per_process_memory_fraction` set to `fraction`
/// (PyTorch's allocator refuses to grow past that share of the GPU's memory), the
/// other options of `current` kept.
pub(crate) fn alloc_conf_with_fraction(current: Option<&str>, fraction: f64) -> String {
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
    /// A reservation of `gpus` under `locks`, no fence raised yet.
    pub(crate) fn new(
        gpus: Vec<ReservedGpu>,
        locks: Vec<GpuLock>,
        share_fraction: Option<f64>,
    ) -> Reservation {
        Reservation {
            keeper: None,
            fences: Vec::new(),
            locks,
            gpus,
            share_fraction,
        }
    }

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
    pub(crate) fn record_fences(&mut self) {
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
