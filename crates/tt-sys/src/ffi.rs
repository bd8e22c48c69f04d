//! Raw declarations of `csrc/shim.h`. Private: the safe wrappers live in `cuda.rs`.

use std::os::raw::c_char;

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(crate) struct TtStat {
    pub(crate) current: i64,
    pub(crate) peak: i64,
    pub(crate) allocated: i64,
    pub(crate) freed: i64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(crate) struct TtDeviceStats {
    pub(crate) allocated_bytes: TtStat,
    pub(crate) reserved_bytes: TtStat,
    pub(crate) active_bytes: TtStat,
    pub(crate) requested_bytes: TtStat,
    pub(crate) num_alloc_retries: i64,
    pub(crate) num_ooms: i64,
    pub(crate) num_device_alloc: i64,
    pub(crate) num_device_free: i64,
}

extern "C" {
    pub(crate) fn tt_free_error(err: *mut c_char);
    pub(crate) fn tt_torch_version() -> *const c_char;
    pub(crate) fn tt_c10_library_path(out_path: *mut *mut c_char) -> *mut c_char;
    pub(crate) fn tt_cuda_device_count(out: *mut i32) -> *mut c_char;
    pub(crate) fn tt_cuda_runtime_version(out: *mut i64) -> *mut c_char;
    pub(crate) fn tt_cuda_device_stats(device: i32, out: *mut TtDeviceStats) -> *mut c_char;
    pub(crate) fn tt_cuda_empty_cache() -> *mut c_char;
    pub(crate) fn tt_cuda_reset_peak_stats(device: i32) -> *mut c_char;
    pub(crate) fn tt_cuda_mem_get_info(device: i32, free: *mut u64, total: *mut u64)
        -> *mut c_char;
    pub(crate) fn tt_autocast_set(
        device_type: i32,
        enabled: bool,
        dtype: i32,
        prev_enabled: *mut bool,
        prev_dtype: *mut i32,
    ) -> *mut c_char;
    pub(crate) fn tt_autocast_nesting(enter: bool) -> *mut c_char;
    pub(crate) fn tt_set_grads_none(tensors: *const *mut std::ffi::c_void, n: usize)
        -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tt_foreach_adam(
        params: *const *mut std::ffi::c_void,
        grads: *const *mut std::ffi::c_void,
        exp_avgs: *const *mut std::ffi::c_void,
        exp_avg_sqs: *const *mut std::ffi::c_void,
        n: usize,
        step_sizes: *const f64,
        bias_correction2_sqrts: *const f64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: bool,
        maximize: bool,
    ) -> *mut c_char;
    pub(crate) fn tt_copy_to_host_async(
        src: *const *mut std::ffi::c_void,
        n: usize,
        device: i32,
        out: *mut *mut std::ffi::c_void,
        out_event: *mut *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub(crate) fn tt_empty_pinned(n: i64, out: *mut *mut std::ffi::c_void) -> *mut c_char;
    pub(crate) fn tt_copy_to_device_async(
        dst: *mut std::ffi::c_void,
        src: *mut std::ffi::c_void,
        out_event: *mut *mut std::ffi::c_void,
    ) -> *mut c_char;
    pub(crate) fn tt_event_synchronize(event: *mut std::ffi::c_void) -> *mut c_char;
    pub(crate) fn tt_event_free(event: *mut std::ffi::c_void);
}

/// Turns the shim's return value into a `Result`, freeing the message.
///
/// # Safety
/// `err` must be null or a pointer returned by a shim function, not yet freed.
pub(crate) unsafe fn check(err: *mut c_char) -> Result<(), String> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: non-null shim errors are NUL-terminated strings from malloc (caller's contract).
    let msg = unsafe { std::ffi::CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: the shim allocated it with malloc; it is freed exactly once, here.
    unsafe { tt_free_error(err) };
    Err(msg)
}

/// Takes ownership of a malloc'd C string from the shim.
///
/// # Safety
/// `s` must be a non-null, NUL-terminated string allocated by the shim.
pub(crate) unsafe fn take_string(s: *mut c_char) -> String {
    // SAFETY: caller's contract.
    let out = unsafe { std::ffi::CStr::from_ptr(s) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: allocated with malloc by the shim; freed once.
    unsafe { tt_free_error(s) };
    out
}
