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

/// The child of the load-order test: libtorch is asked about CUDA before torchtools
/// loads libtorch's CUDA library, as a program calling `tch::Cuda::is_available()` or
/// `tch::manual_seed` first in `main` does.
#[test]
#[ignore = "a child process's entry point, run by the load-order test"]
fn asked_too_early_child() {
    if std::env::var_os("TT_SYS_EARLY_CHILD").is_none() {
        return;
    }
    let first = tch::Cuda::is_available();
    match tt_sys::ensure_cuda_loaded() {
        Ok(info) => println!(
            "@@early first={first} loaded devices={} tch={}",
            info.device_count,
            tch::Cuda::device_count()
        ),
        Err(e) => println!("@@early first={first} error {e:?} / {e}"),
    }
}

/// The child's `@@early` line, with `TORCHTOOLS_CUDA_PRELOAD` as given.
fn asked_too_early(preload: Option<&str>) -> String {
    let mut cmd = tt_testkit::rerun("asked_too_early_child");
    cmd.env("TT_SYS_EARLY_CHILD", "1")
        .env_remove("TORCHTOOLS_CUDA_PRELOAD");
    if let Some(p) = preload {
        cmd.env("TORCHTOOLS_CUDA_PRELOAD", p);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("@@early").map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| panic!("{out:?}"));
    println!("TORCHTOOLS_CUDA_PRELOAD={preload:?}:{line}");
    line
}

#[test]
fn asking_libtorch_about_cuda_first_in_main_still_finds_the_gpu() {
    let info = tt_sys::require_cuda();
    // libtorch's CUDA library is loaded before main: the first question gets the truth.
    let line = asked_too_early(None);
    assert!(
        line.contains("first=true")
            && line.contains(&format!(
                "loaded devices={} tch={}",
                info.device_count, info.device_count
            )),
        "{line}"
    );
    // Without that, libtorch keeps its first answer, and the error says so and what to do.
    let line = asked_too_early(Some("0"));
    assert!(
        line.contains("first=false")
            && line.contains("QueriedTooEarly")
            && line.contains("TORCHTOOLS_CUDA_PRELOAD"),
        "{line}"
    );
}

/// `torch.autocast("cuda", dtype)`: matrix products on CUDA run in the autocast dtype
/// inside the region, precision-sensitive operations (log-softmax) in float32, and
/// everything is float32 again outside; a CPU region leaves CUDA alone.
#[test]
fn autocast_runs_cuda_matmuls_in_bf16_and_fp16_and_stops_outside() {
    tt_sys::require_cuda();
    let dev = Device::Cuda(0);
    tch::manual_seed(0);
    let a = Tensor::randn([64, 64], (Kind::Float, dev));
    let full = a.matmul(&a);
    for dtype in [Kind::BFloat16, Kind::Half] {
        let (product, sensitive) = tt_sys::autocast(dev, dtype, || {
            let p = a.matmul(&a);
            let s = p.log_softmax(-1, None::<Kind>);
            (p, s)
        })
        .unwrap();
        assert_eq!(product.kind(), dtype, "a matmul inside autocast({dtype:?})");
        assert_eq!(product.device(), dev);
        assert_eq!(sensitive.kind(), Kind::Float, "log_softmax stays float32");
        // The product is the float32 one, to the dtype's precision.
        let rel = ((product.to_kind(Kind::Float) - &full).abs().max() / full.abs().max())
            .double_value(&[]);
        assert!(
            rel > 0.0 && rel < 2e-2,
            "{dtype:?}: relative difference {rel}"
        );
        assert_eq!(a.matmul(&a).kind(), Kind::Float, "autocast left on");
    }
    // A CPU region is the CPU's: CUDA products stay float32 in it.
    let on_cuda = tt_sys::autocast(Device::Cpu, Kind::BFloat16, || a.matmul(&a)).unwrap();
    assert_eq!(on_cuda.kind(), Kind::Float);
}

/// Bytes uploaded through the pinned buffers are what a kernel queued next reads (the
/// stream orders them; no wait in between), over more pieces than buffers; a target of
/// the wrong size, on the host, or not contiguous is an error naming it.
#[test]
fn uploads_reach_the_next_kernel_and_bad_targets_are_refused() {
    tt_sys::require_cuda();
    let dev = Device::Cuda(0);
    let n = (tt_sys::DeviceUploads::DEPTH + 2) * tt_sys::DeviceUploads::CHUNK / 4 + 5;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let mut up = tt_sys::DeviceUploads::new(dev).unwrap();
    let dst = Tensor::empty([n as i64], (Kind::Float, dev));
    up.copy_into(&dst, &bytes).unwrap();
    drop(bytes);
    // Queued after the uploads on the same stream: sees every value.
    let sum = dst.sum(Kind::Double).double_value(&[]);
    let want: f64 = values.iter().map(|&v| v as f64).sum();
    assert_eq!(sum, want);
    up.finish().unwrap();

    let mut up = tt_sys::DeviceUploads::new(dev).unwrap();
    let small = Tensor::empty([4], (Kind::Float, dev));
    let err = up.copy_into(&small, &[0u8; 15]).unwrap_err().to_string();
    assert!(err.contains("holds 16 bytes, the source has 15"), "{err}");
    let host = Tensor::empty([4], (Kind::Float, Device::Cpu));
    let err = up.copy_into(&host, &[0u8; 16]).unwrap_err().to_string();
    assert!(err.contains("not on cuda:0"), "{err}");
    let strided = Tensor::empty([4, 4], (Kind::Float, dev)).tr();
    let err = up.copy_into(&strided, &[0u8; 64]).unwrap_err().to_string();
    assert!(err.contains("not contiguous"), "{err}");
    up.finish().unwrap();
}
