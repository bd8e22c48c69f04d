//! Loading libtorch's CUDA library and reading its caching allocator.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{CudaUnavailable, Error, Result};
use crate::ffi;

/// CUDA as libtorch sees it, once [`ensure_cuda_loaded`] succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// The `libtorch_cuda.so` that was loaded.
    pub library: PathBuf,
    /// Number of visible CUDA devices (logical indices `0..device_count`).
    pub device_count: usize,
    /// CUDA runtime version libtorch was built with, e.g. `13000` for 13.0.
    pub runtime_version: i64,
}

/// The libtorch version the shim was compiled against, e.g. `"2.11.0"`.
pub fn libtorch_version() -> &'static str {
    // SAFETY: returns a pointer to a static NUL-terminated literal.
    let ptr = unsafe { ffi::tt_torch_version() };
    // SAFETY: non-null static string (see above).
    unsafe { CStr::from_ptr(ptr) }.to_str().unwrap_or("unknown")
}

/// The directory holding the libtorch libraries this process loaded.
pub fn libtorch_lib_dir() -> Result<PathBuf> {
    let mut out: *mut std::os::raw::c_char = std::ptr::null_mut();
    // SAFETY: `out` is a valid out-pointer; the returned error is handled by `check`.
    unsafe { ffi::check(ffi::tt_c10_library_path(&mut out)) }.map_err(|message| Error::Torch {
        op: "locate libc10.so",
        reason: message,
    })?;
    // SAFETY: on success the shim stored a malloc'd, NUL-terminated path.
    let path = PathBuf::from(unsafe { ffi::take_string(out) });
    Ok(path.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// Loads `libtorch_cuda.so` (once per process) so that libtorch, and `tch::Cuda`,
/// can use CUDA; returns why not otherwise.
///
/// tch links libtorch with `--as-needed`, which drops `libtorch_cuda.so` from
/// binaries that call nothing in it: `tch::Cuda::is_available()` is then false on a
/// GPU machine. Loading it with `RTLD_NOW | RTLD_GLOBAL` registers libtorch's CUDA
/// hooks, in every binary, with no linker flags. The library is looked up beside the
/// `libc10.so` in use, so it always matches the libtorch that is loaded.
///
/// The result is computed once and cached; later calls are cheap.
pub fn ensure_cuda_loaded() -> Result<&'static CudaInfo, CudaUnavailable> {
    static STATE: OnceLock<Result<CudaInfo, CudaUnavailable>> = OnceLock::new();
    STATE.get_or_init(load_cuda).as_ref().map_err(Clone::clone)
}

fn dlopen(path: &str, flags: libc::c_int) -> Result<*mut libc::c_void, String> {
    let c_path = CString::new(path).map_err(|_| format!("path {path:?} contains a NUL byte"))?;
    // SAFETY: `c_path` is NUL-terminated and outlives the call.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), flags) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a thread-local NUL-terminated string.
        let err = unsafe { libc::dlerror() };
        let reason = if err.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            // SAFETY: non-null result of dlerror, valid until the next dl* call.
            unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(reason);
    }
    Ok(handle)
}

fn load_cuda() -> Result<CudaInfo, CudaUnavailable> {
    // Read (as 0 or anything else) before main by the shim; checked here, where an
    // error can be reported: a typo must not pass for the default.
    if let Ok(value) = std::env::var("TORCHTOOLS_CUDA_PRELOAD") {
        if !matches!(value.trim(), "" | "0" | "1") {
            return Err(CudaUnavailable::BadPreload { value });
        }
    }
    let dir = libtorch_lib_dir().map_err(|e| CudaUnavailable::Torch {
        reason: e.to_string(),
    })?;
    let library = dir.join("libtorch_cuda.so");
    if !library.exists() {
        return Err(CudaUnavailable::CpuOnlyLibtorch { dir });
    }
    let lib_str = library.to_string_lossy().into_owned();
    // The handle is deliberately never closed: libtorch_cuda stays for the process.
    dlopen(&lib_str, libc::RTLD_NOW | libc::RTLD_GLOBAL).map_err(|reason| {
        CudaUnavailable::LoadFailed {
            path: library.clone(),
            reason,
        }
    })?;
    // Ask for the driver before libtorch does, so that a machine without one gets a
    // clear reason rather than libtorch's warning on stderr.
    let driver = dlopen("libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL)
        .map_err(|reason| CudaUnavailable::NoDriver { reason })?;
    // SAFETY: `driver` is a live handle from dlopen; libtorch holds its own reference.
    unsafe { libc::dlclose(driver) };
    let mut count: i32 = 0;
    // SAFETY: valid out-pointer; errors are returned, not thrown.
    unsafe { ffi::check(ffi::tt_cuda_device_count(&mut count)) }
        .map_err(|reason| CudaUnavailable::Torch { reason })?;
    let mut runtime_version: i64 = 0;
    // SAFETY: valid out-pointer; errors are returned, not thrown.
    if let Err(message) = unsafe { ffi::check(ffi::tt_cuda_runtime_version(&mut runtime_version)) }
    {
        // libtorch's CPU-only stub answers "Cannot query CUDART version without ATen_cuda
        // library": it was asked before its CUDA library was loaded.
        return Err(match ask_driver() {
            Some((_, devices)) if devices > 0 && count <= 0 => CudaUnavailable::QueriedTooEarly {
                driver_devices: devices as usize,
            },
            _ => CudaUnavailable::Torch { reason: message },
        });
    }
    if count <= 0 {
        let visible =
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".to_owned());
        return Err(why_no_device(ask_driver(), runtime_version, visible));
    }
    Ok(CudaInfo {
        library,
        device_count: count as usize,
        runtime_version,
    })
}

/// `cuDriverGetVersion` and `cuDeviceGetCount` of the driver itself (after `cuInit`);
/// `None` when it cannot be asked.
fn ask_driver() -> Option<(i32, i32)> {
    type Call = unsafe extern "C" fn(*mut libc::c_int) -> libc::c_int;
    type Init = unsafe extern "C" fn(libc::c_uint) -> libc::c_int;
    let driver = dlopen("libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL).ok()?;
    let symbol = |name: &CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(driver, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let answer = (|| {
        let init = symbol(c"cuInit")?;
        let version = symbol(c"cuDriverGetVersion")?;
        let count = symbol(c"cuDeviceGetCount")?;
        // SAFETY: the CUDA driver API's documented signatures for these three symbols.
        let (init, version, count): (Init, Call, Call) = unsafe {
            (
                std::mem::transmute::<*mut libc::c_void, Init>(init),
                std::mem::transmute::<*mut libc::c_void, Call>(version),
                std::mem::transmute::<*mut libc::c_void, Call>(count),
            )
        };
        let (mut v, mut n) = (0, 0);
        // SAFETY: valid out-pointers; the driver returns status codes, never throws.
        unsafe {
            if version(&mut v) != 0 {
                return None;
            }
            n = if init(0) == 0 && count(&mut n) == 0 {
                n
            } else {
                0
            };
        }
        Some((v, n))
    })();
    // SAFETY: the handle from dlopen above; the driver stays loaded by libtorch's own.
    unsafe { libc::dlclose(driver) };
    answer
}

/// `major.minor` of a CUDA version number (`13000` -> `13.0`).
fn cuda_version(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Why libtorch sees no device, from the driver's own answer (its CUDA version and
/// device count, when it could be asked) and libtorch's runtime version.
fn why_no_device(driver: Option<(i32, i32)>, runtime: i64, visible: String) -> CudaUnavailable {
    match driver {
        Some((version, _)) if version > 0 && i64::from(version) < runtime => {
            CudaUnavailable::DriverTooOld {
                driver_cuda: cuda_version(i64::from(version)),
                runtime_cuda: cuda_version(runtime),
            }
        }
        Some((_, devices)) if devices > 0 => CudaUnavailable::QueriedTooEarly {
            driver_devices: devices as usize,
        },
        _ => CudaUnavailable::NoDevice {
            visible: format!("{visible:?}"),
        },
    }
}

fn checked_device(device: usize) -> Result<i32> {
    let info = ensure_cuda_loaded()?;
    if device >= info.device_count {
        return Err(Error::DeviceOutOfRange {
            device,
            count: info.device_count,
        });
    }
    i32::try_from(device).map_err(|_| Error::DeviceOutOfRange {
        device,
        count: info.device_count,
    })
}

/// One statistic of the caching allocator, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value since the process started or [`reset_peak_stats`].
    pub peak: u64,
    /// Sum of all increases (cumulative).
    pub allocated: u64,
    /// Sum of all decreases (cumulative).
    pub freed: u64,
}

impl From<ffi::TtStat> for Stat {
    fn from(s: ffi::TtStat) -> Self {
        let u = |v: i64| u64::try_from(v).unwrap_or(0);
        Stat {
            current: u(s.current),
            peak: u(s.peak),
            allocated: u(s.allocated),
            freed: u(s.freed),
        }
    }
}

/// Statistics of libtorch's CUDA caching allocator for one device (the
/// `torch.cuda.memory_stats()` "all" pool).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Bytes in tensors (`torch.cuda.memory_allocated`).
    pub allocated_bytes: Stat,
    /// Bytes held from the driver, used or cached (`torch.cuda.memory_reserved`).
    pub reserved_bytes: Stat,
    /// Bytes in active blocks (allocated, or in use by a stream).
    pub active_bytes: Stat,
    /// Bytes asked for by callers, before rounding.
    pub requested_bytes: Stat,
    /// Failed driver allocations that forced the cache to be flushed and retried.
    pub num_alloc_retries: u64,
    /// Out-of-memory errors raised.
    pub num_ooms: u64,
    /// `cudaMalloc` calls made.
    pub num_device_alloc: u64,
    /// `cudaFree` calls made.
    pub num_device_free: u64,
}

/// Free and total memory of a device as the driver reports it (`cudaMemGetInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes free on the device, for every process.
    pub free: u64,
    /// Bytes on the device.
    pub total: u64,
}

/// Caching-allocator statistics of CUDA device `device` (a logical index).
pub fn device_stats(device: usize) -> Result<DeviceStats> {
    let idx = checked_device(device)?;
    let mut raw = ffi::TtDeviceStats::default();
    // SAFETY: valid out-pointer; device index checked; errors are returned, not thrown.
    unsafe { ffi::check(ffi::tt_cuda_device_stats(idx, &mut raw)) }.map_err(|message| {
        Error::Torch {
            op: "getDeviceStats",
            reason: message,
        }
    })?;
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(DeviceStats {
        allocated_bytes: raw.allocated_bytes.into(),
        reserved_bytes: raw.reserved_bytes.into(),
        active_bytes: raw.active_bytes.into(),
        requested_bytes: raw.requested_bytes.into(),
        num_alloc_retries: u(raw.num_alloc_retries),
        num_ooms: u(raw.num_ooms),
        num_device_alloc: u(raw.num_device_alloc),
        num_device_free: u(raw.num_device_free),
    })
}

/// Returns the allocator's unused cached blocks to the driver
/// (`torch.cuda.empty_cache()`), on every device.
pub fn empty_cache() -> Result<()> {
    ensure_cuda_loaded()?;
    // SAFETY: no arguments; errors are returned, not thrown.
    unsafe { ffi::check(ffi::tt_cuda_empty_cache()) }.map_err(|message| Error::Torch {
        op: "emptyCache",
        reason: message,
    })
}

/// Resets the peak values of [`device_stats`] for `device` to their current values.
pub fn reset_peak_stats(device: usize) -> Result<()> {
    let idx = checked_device(device)?;
    // SAFETY: device index checked; errors are returned, not thrown.
    unsafe { ffi::check(ffi::tt_cuda_reset_peak_stats(idx)) }.map_err(|message| Error::Torch {
        op: "resetPeakStats",
        reason: message,
    })
}

/// Free and total bytes of `device` (`torch.cuda.mem_get_info`). Creates the CUDA
/// context on that device if this process had none.
pub fn mem_get_info(device: usize) -> Result<MemInfo> {
    let idx = checked_device(device)?;
    let (mut free, mut total) = (0u64, 0u64);
    // SAFETY: valid out-pointers; device index checked; errors are returned, not thrown.
    unsafe { ffi::check(ffi::tt_cuda_mem_get_info(idx, &mut free, &mut total)) }.map_err(
        |message| Error::Torch {
            op: "getMemoryInfo",
            reason: message,
        },
    )?;
    Ok(MemInfo { free, total })
}

#[cfg(test)]
mod tests {
    use super::{why_no_device, CudaUnavailable};

    #[test]
    fn no_device_is_explained_by_the_drivers_own_answer() {
        // A 12.8 driver (e.g. 570) under libtorch's CUDA 13.0 runtime.
        let e = why_no_device(Some((12080, 1)), 13000, "<unset>".into());
        assert_eq!(
            e,
            CudaUnavailable::DriverTooOld {
                driver_cuda: "12.8".into(),
                runtime_cuda: "13.0".into()
            }
        );
        let text = e.to_string();
        assert!(text.contains("580") && text.contains("CUDA 13.0"), "{text}");
        // A recent enough driver that sees a GPU: libtorch was asked too early.
        let e = why_no_device(Some((13000, 2)), 13000, "<unset>".into());
        assert_eq!(e, CudaUnavailable::QueriedTooEarly { driver_devices: 2 });
        assert!(e.to_string().contains("ensure_cuda_loaded"), "{e}");
        // The driver sees none either (or cannot be asked): nothing visible.
        for driver in [Some((13000, 0)), None] {
            let e = why_no_device(driver, 13000, "\"\"".into());
            assert!(matches!(e, CudaUnavailable::NoDevice { .. }), "{e:?}");
        }
    }
}
