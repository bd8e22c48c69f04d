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
    // Initialise libtorch's CUDA state first, as a training program would.
    let _warm = Tensor::zeros([1], (Kind::Float, Device::Cuda(0)));
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
