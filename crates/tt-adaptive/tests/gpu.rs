//! GPU test (`cargo xtask test-gpu`): a real CUDA out-of-memory retried to success, and
//! remembered by the call site.
#![allow(clippy::unwrap_used)]

use tch::{Device, Kind, TchError, Tensor};
use tt_adaptive::{Adaptive, CudaMemory};

#[test]
fn a_real_cuda_oom_is_retried_and_the_cache_remembers_it() {
    tt_sys::require_cuda();
    let free_mib = tt_sys::mem_get_info(0).unwrap().free >> 20;
    let a = Adaptive::new().memory(CudaMemory(0));
    // Batches of n MiB; the first asks for twice the free memory.
    let run = |a: &Adaptive| {
        a.batch(2 * free_mib as usize, |n| {
            let t = Tensor::f_zeros([n as i64, 1 << 18], (Kind::Float, Device::Cuda(0)))?;
            Ok::<_, TchError>(t.size()[0] as u64)
        })
        .unwrap()
    };
    let first = run(&a);
    let ooms_first: u64 = a.stats().iter().map(|s| s.ooms).sum();
    assert!(
        ooms_first >= 1 && first < free_mib,
        "{first} MiB of {free_mib}"
    );
    let second = run(&a);
    let ooms_second: u64 = a.stats().iter().map(|s| s.ooms).sum();
    println!("first {first} MiB, second {second} MiB, OOMs {ooms_first} then {ooms_second}");
    assert!(second >= first);
    assert!(
        ooms_second - ooms_first <= 1,
        "the second call starts from what the first learnt"
    );
}
