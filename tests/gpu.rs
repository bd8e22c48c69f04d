//! GPU tests of the facade's flows (`cargo xtask test-gpu`): the fence and libtorch in
//! one process, sharing the primary context.
#![allow(clippy::unwrap_used)]

use tch::{Device, Kind, Tensor};
use torchtools::device::Bytes;
use torchtools::lock::GpuSpec;
use torchtools::{reserve_gpu_for_training, ReserveOptions};

#[test]
fn libtorch_gets_what_the_fence_gives_back() {
    torchtools::sys::require_cuda();
    let tmp = tempfile::tempdir().unwrap();
    std::env::set_var("TORCHTOOLS_LOCK_DIR", tmp.path());
    // Initialise libtorch's CUDA state first, as a training program would; nothing
    // cached by an earlier test of this process may stand in for the driver's memory.
    let _warm = Tensor::zeros([1], (Kind::Float, Device::Cuda(0)));
    torchtools::sys::empty_cache().unwrap();
    let mut r = reserve_gpu_for_training(ReserveOptions {
        gpus: vec![GpuSpec::Cuda(0)],
        training_reserved_bytes: Bytes::gib(2),
        ..ReserveOptions::default()
    })
    .unwrap();
    assert_eq!(r.ordinal(), Some(0));
    assert_eq!(r.device().unwrap(), Device::Cuda(0));
    assert!(r.fenced().0 > 0);
    let free = torchtools::sys::mem_get_info(0).unwrap().free;
    let expected = Bytes::gib(2).0 + torchtools::fence::DEFAULT_SAFETY_MARGIN.0;
    assert!(
        free.abs_diff(expected) < 256 << 20,
        "free {} with the fence up, expected about {}",
        Bytes(free),
        Bytes(expected)
    );

    // 3 GiB does not fit beside the fence...
    let big = [3i64 << 30];
    assert!(Tensor::f_zeros(big, (Kind::Uint8, Device::Cuda(0))).is_err());
    torchtools::sys::empty_cache().unwrap();
    // ...until the fence hands 2 GiB back: then libtorch's allocator gets it.
    let freed = r.release_fence(Bytes::gib(2)).unwrap();
    assert!(freed.0 >= 2 << 30, "{freed}");
    let t = Tensor::f_zeros(big, (Kind::Uint8, Device::Cuda(0))).unwrap();
    assert_eq!(t.size(), big);
    drop(t);
    let lowered = r.lower_fences().unwrap();
    assert_eq!(r.fenced(), Bytes(0));
    println!("released {freed} then {lowered}");
}

/// Zeros of `mib` MiB on the GPU, or libtorch's CUDA out-of-memory error.
fn mib_on_gpu(mib: usize) -> Result<usize, tch::TchError> {
    let t = Tensor::f_zeros([mib as i64, 1 << 20], (Kind::Uint8, Device::Cuda(0)))?;
    Ok(t.size()[0] as usize)
}

#[test]
fn a_real_cuda_oom_takes_fence_memory_back_and_retries_the_same_size_once() {
    use std::sync::{Arc, Mutex};
    use torchtools::adaptive::{Adaptive, CudaMemory, Policy};
    use torchtools::reserve::fence_release_hook;

    torchtools::sys::require_cuda();
    let tmp = tempfile::tempdir().unwrap();
    std::env::set_var("TORCHTOOLS_LOCK_DIR", tmp.path());
    let _warm = Tensor::zeros([1], (Kind::Float, Device::Cuda(0)));
    torchtools::sys::empty_cache().unwrap();
    let r = reserve_gpu_for_training(ReserveOptions {
        gpus: vec![GpuSpec::Cuda(0)],
        training_reserved_bytes: Bytes::gib(2),
        ..ReserveOptions::default()
    })
    .unwrap();
    let fenced_before = r.fenced();
    let r = Arc::new(Mutex::new(r));
    let adaptive = Adaptive::new()
        .policy(Policy::Halve)
        .memory(CudaMemory(0))
        .on_oom(fence_release_hook(Arc::clone(&r), Bytes::gib(2)));

    // 3 GiB with 2 GiB left free: one real OOM, the hook hands 2 GiB of the fence
    // back, and the same size fits.
    let mut tried = Vec::new();
    let got = adaptive
        .batch(3072, |n| {
            tried.push(n);
            mib_on_gpu(n)
        })
        .unwrap();
    assert_eq!((got, tried.as_slice()), (3072, &[3072, 3072][..]));
    let released = fenced_before.0 - r.lock().unwrap().fenced().0;
    // The fence is held in chunks of at most 1 GiB: it gives back whole chunks.
    assert!(
        (2 << 30..3 << 30).contains(&released),
        "the fence gave back {}",
        Bytes(released)
    );

    // Twice the GPU: the hook's 2 GiB cannot make room, so after one retry at the same
    // size the size is lowered, as without a fence.
    let twice = 2 * (torchtools::sys::mem_get_info(0).unwrap().total >> 20) as usize;
    tried.clear();
    let got = adaptive
        .batch(twice, |n| {
            tried.push(n);
            mib_on_gpu(n)
        })
        .unwrap();
    assert!(tried.len() >= 3, "{tried:?}");
    assert_eq!(&tried[..3], &[twice, twice, twice / 2], "{tried:?}");
    assert_eq!(got, *tried.last().unwrap());
    assert!(got < twice / 2, "{tried:?}");
    drop(r);
    torchtools::sys::empty_cache().unwrap();
    println!(
        "fence released {} on the first OOM; sizes tried {tried:?}",
        Bytes(released)
    );
}
