//! Free memory for the cache key, and toma's CPU memory limit.

use std::io;

/// Reads how much memory is free where the work runs.
pub trait MemoryProbe: Send + Sync {
    /// Free bytes, or `None` when it cannot be told.
    fn free_bytes(&self) -> Option<u64>;
}

/// The CPU: [`available_cpu_memory`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuMemory;

impl MemoryProbe for CpuMemory {
    fn free_bytes(&self) -> Option<u64> {
        available_cpu_memory().ok()
    }
}

/// Free memory of CUDA device `n` as libtorch's allocator sees it: the driver's free
/// memory plus what the caching allocator holds but does not use (so the second call
/// of a call site, after the first one's tensors went back to the cache, finds the
/// same bucket).
#[derive(Debug, Clone, Copy)]
#[cfg(feature = "tch")]
pub struct CudaMemory(pub usize);

#[cfg(feature = "tch")]
impl MemoryProbe for CudaMemory {
    fn free_bytes(&self) -> Option<u64> {
        let info = tt_sys::mem_get_info(self.0).ok()?;
        let stats = tt_sys::device_stats(self.0).ok()?;
        Some(
            info.free
                + stats
                    .reserved_bytes
                    .current
                    .saturating_sub(stats.allocated_bytes.current),
        )
    }
}

/// The free memory of the device this process trains on, as tt-device selects it
/// (`TORCHTOOLS_DEVICE`, `LOCAL_RANK` under a launcher): a GPU's as [`CudaMemory`]
/// reads it, else the CPU's. The cache key of
/// [`Adaptive::new`](crate::Adaptive::new) with the `tch` feature, as toma keys on CUDA
/// memory. The device is chosen at the first read (no
/// cost before the first adaptive call); a selection that fails (a bad variable) falls
/// back to the CPU's memory with a warning, since a cache key is no place to fail.
#[cfg(feature = "tch")]
#[derive(Debug, Default)]
pub struct DeviceMemory {
    chosen: std::sync::OnceLock<tch::Device>,
}

#[cfg(feature = "tch")]
impl DeviceMemory {
    /// The device whose memory is read.
    pub fn device(&self) -> tch::Device {
        *self.chosen.get_or_init(|| match tt_device::select() {
            Ok(device) => device,
            Err(e) => {
                tracing::warn!("adaptive cache keyed by CPU memory: {e}");
                tch::Device::Cpu
            }
        })
    }
}

#[cfg(feature = "tch")]
impl MemoryProbe for DeviceMemory {
    fn free_bytes(&self) -> Option<u64> {
        match self.device() {
            tch::Device::Cuda(i) => CudaMemory(i).free_bytes(),
            _ => CpuMemory.free_bytes(),
        }
    }
}

/// Errors of the CPU memory limit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// The CUDA driver is loaded: its contexts reserve far more address space than
    /// memory, so an address-space limit would break them.
    #[error(
        "refusing to limit the address space (RLIMIT_AS): the CUDA driver is loaded in this \
         process and its contexts reserve far more address space than memory; limit memory \
         with a cgroup (e.g. systemd-run -p MemoryMax=) instead"
    )]
    CudaLoaded,
    /// The limit is below what the process already uses.
    #[error("a limit of {limit} bytes is below the {used} bytes of address space this process already uses")]
    BelowUsage {
        /// The limit asked for.
        limit: u64,
        /// VmSize now.
        used: u64,
    },
    /// setrlimit failed.
    #[error("setrlimit(RLIMIT_AS): {cause}")]
    Os {
        /// The OS error (in the message, not also the `source()`).
        cause: io::Error,
    },
}

/// The address space this process maps now (`VmSize` in `/proc/self/status`), in bytes:
/// what a limit set by [`set_cpu_memory_limit`] counts, so a limit is best given as this
/// plus the room a computation may use.
pub fn address_space_in_use() -> Option<u64> {
    tt_device::procfs::status(std::process::id())?.vm_size
}

/// Whether the CUDA driver (`libcuda.so`) is loaded in this process: only then can a
/// CUDA context exist, with its huge address-space reservation. libtorch's CUDA
/// libraries alone (`libtorch_cuda.so`, which the CUDA wheel maps into every binary
/// that selects a device, even on a machine without a driver) do not count.
pub fn cuda_loaded() -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .is_ok_and(|maps| maps.lines().any(|l| l.contains("/libcuda.so")))
}

/// Sets the soft address-space limit (`RLIMIT_AS`) to `bytes` (toma's
/// `set_cpu_memory_limit`, in bytes rather than GB), keeping the hard limit so that it
/// can be raised back; `None` removes it (up to the hard limit). Allocations past it
/// fail with libtorch's CPU OOM, which the adaptive helpers retry. Refused when the CUDA
/// driver is loaded (see [`cuda_loaded`] and [`LimitError::CudaLoaded`]); libtorch's
/// CUDA libraries without a driver are fine.
///
/// glibc's malloc keeps address space this limit does not see (64 MiB reserved per
/// thread arena, freed blocks kept in the heap): for a limit that counts every
/// allocation, set `mallopt(M_ARENA_MAX, 1)` and a fixed `M_MMAP_THRESHOLD` before any
/// thread starts (the crate README shows how).
pub fn set_cpu_memory_limit(bytes: Option<u64>) -> Result<(), LimitError> {
    let mut lim = address_space_rlimit().map_err(|cause| LimitError::Os { cause })?;
    match bytes {
        Some(limit) => {
            if cuda_loaded() {
                return Err(LimitError::CudaLoaded);
            }
            let used = address_space_in_use().unwrap_or(0);
            if limit < used {
                return Err(LimitError::BelowUsage { limit, used });
            }
            lim.rlim_cur = limit.min(lim.rlim_max);
        }
        None => lim.rlim_cur = lim.rlim_max,
    }
    // SAFETY: setrlimit with a valid rlimit; the soft limit never exceeds the hard one.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(LimitError::Os {
            cause: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Memory this process can still use: the system's `MemAvailable`, capped by the room
/// left under a soft `RLIMIT_AS` (limit − VmSize).
pub fn available_cpu_memory() -> io::Result<u64> {
    let available = tt_device::procfs::meminfo()
        .ok_or_else(|| io::Error::other("cannot read MemAvailable in /proc/meminfo"))?
        .available;
    if let Ok(Some(limit)) = address_space_limit() {
        let room = limit.saturating_sub(address_space_in_use().unwrap_or(0));
        return Ok(available.min(room));
    }
    Ok(available)
}

/// This process's soft address-space limit in bytes (`ulimit -v`, `RLIMIT_AS`: what
/// [`set_cpu_memory_limit`] sets); `None` where there is none.
///
/// ```
/// // Unlimited in most shells; the limit otherwise.
/// let _limit: Option<u64> = tt_adaptive::address_space_limit().unwrap();
/// ```
pub fn address_space_limit() -> io::Result<Option<u64>> {
    let lim = address_space_rlimit()?;
    Ok((lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur))
}

/// The soft and hard `RLIMIT_AS`, as the kernel holds them.
fn address_space_rlimit() -> io::Result<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a valid rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(lim)
}

/// After a CUDA-side OOM, hand libtorch's cached blocks back to the driver, so that the
/// next attempt (or another process) can use them. Never on the success path.
#[cfg(feature = "tch")]
pub(crate) fn release_cached_memory(kind: crate::OomKind) {
    if matches!(
        kind,
        crate::OomKind::Cuda | crate::OomKind::Cudnn | crate::OomKind::Cublas
    ) {
        if let Err(e) = tt_sys::empty_cache() {
            tracing::debug!("empty_cache after an OOM: {e}");
        }
    }
}

/// Without libtorch there is no cache to release.
#[cfg(not(feature = "tch"))]
pub(crate) fn release_cached_memory(_kind: crate::OomKind) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_space_in_use_is_vmsize_and_grows_with_a_mapping() {
        // Other tests' threads may unmap as much at the same moment (glibc deletes a
        // thread arena's 64 MiB heap when it empties: seen once in CI, +4 KiB): the
        // growth must show in one of a few tries, each measured around its own block.
        let mut seen = Vec::new();
        for _ in 0..10 {
            let before = address_space_in_use().unwrap_or(0);
            assert!(before > 1 << 20, "{before}");
            let block = vec![1u8; 64 << 20];
            let after = address_space_in_use().unwrap_or(0);
            drop(block);
            if after >= before + (60 << 20) {
                return;
            }
            seen.push(format!("{before} -> {after}"));
        }
        panic!("VmSize never grew by the 64 MiB block: {seen:?}");
    }
}
