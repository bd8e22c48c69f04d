//! GPU-only tests, selected by `cargo xtask test-gpu` (feature `gpu-tests`). Each
//! starts with `require_cuda()`, which panics without CUDA: never skipped by luck.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tch::{Device, Kind, Tensor};

const GIB: u64 = 1 << 30;

#[test]
fn cuda_is_available_to_tch_after_ensure_cuda_loaded() {
    let info = tt_sys::require_cuda();
    assert!(info.device_count >= 1);
    assert!(tch::Cuda::is_available());
    assert_eq!(tch::Cuda::device_count() as usize, info.device_count);
    assert!(
        info.runtime_version >= 12000,
        "runtime {}",
        info.runtime_version
    );
}

#[test]
fn allocator_stats_follow_a_one_gib_tensor_and_empty_cache_returns_it() {
    tt_sys::require_cuda();
    tt_sys::empty_cache().unwrap();
    tt_sys::reset_peak_stats(0).unwrap();
    let before = tt_sys::device_stats(0).unwrap();
    let info_before = tt_sys::mem_get_info(0).unwrap();

    let t = Tensor::zeros([(GIB / 4) as i64], (Kind::Float, Device::Cuda(0))); // 1 GiB
    tch::Cuda::synchronize(0);
    let during = tt_sys::device_stats(0).unwrap();
    let info_during = tt_sys::mem_get_info(0).unwrap();
    let grew = during.allocated_bytes.current - before.allocated_bytes.current;
    assert!(
        (GIB..GIB + (64 << 20)).contains(&grew),
        "allocated grew by {grew}"
    );
    assert!(during.allocated_bytes.peak >= before.allocated_bytes.current + GIB);
    assert!(during.reserved_bytes.current >= during.allocated_bytes.current);
    let free_drop = info_before.free.saturating_sub(info_during.free);
    assert!(
        free_drop >= GIB - (64 << 20),
        "free dropped by only {free_drop}"
    );

    drop(t);
    let after_drop = tt_sys::device_stats(0).unwrap();
    assert_eq!(
        after_drop.allocated_bytes.current,
        before.allocated_bytes.current
    );
    assert!(
        after_drop.reserved_bytes.current >= GIB,
        "the cache keeps the block until emptied"
    );
    tt_sys::empty_cache().unwrap();
    let emptied = tt_sys::device_stats(0).unwrap();
    assert!(emptied.reserved_bytes.current + GIB <= after_drop.reserved_bytes.current);
    assert!(tt_sys::mem_get_info(0).unwrap().free >= info_during.free + GIB - (64 << 20));
    // The peak survives the free; reset brings it down to current.
    assert!(emptied.allocated_bytes.peak >= GIB);
    tt_sys::reset_peak_stats(0).unwrap();
    assert_eq!(
        tt_sys::device_stats(0).unwrap().allocated_bytes.peak,
        emptied.allocated_bytes.current
    );
}

#[test]
fn an_out_of_range_device_is_an_error_not_a_crash() {
    let info = tt_sys::require_cuda();
    let err = tt_sys::device_stats(info.device_count + 3).unwrap_err();
    assert!(
        matches!(err, tt_sys::Error::DeviceOutOfRange { .. }),
        "{err}"
    );
}

/// The child of the fresh-process test: allocator calls before libtorch's first CUDA
/// use (what a probe child or an adaptive call does first).
#[test]
#[ignore = "a child process's entry point, run by the fresh-process test"]
fn fresh_process_child() {
    if std::env::var_os("TT_SYS_FRESH_CHILD").is_none() {
        return;
    }
    tt_sys::require_cuda();
    let stats = tt_sys::device_stats(0).expect("stats before the first CUDA use");
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.reserved_bytes.peak, 0);
    tt_sys::reset_peak_stats(0).expect("reset before the first CUDA use");
    let info = tt_sys::mem_get_info(0).expect("free memory before the first CUDA use");
    assert!(info.free > 0 && info.free <= info.total, "{info:?}");
    let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
    let after = tt_sys::device_stats(0).unwrap();
    assert!(after.allocated_bytes.current >= 4 << 20, "{after:?}");
    drop(t);
    println!("@@fresh ok");
}

#[test]
fn the_allocator_answers_before_the_first_cuda_use() {
    tt_sys::require_cuda();
    let out = tt_testkit::rerun("fresh_process_child")
        .env("TT_SYS_FRESH_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("@@fresh ok"),
        "{out:?}"
    );
}
