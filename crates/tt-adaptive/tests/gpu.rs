//! GPU tests (`cargo xtask test-gpu`): real CUDA out-of-memory errors retried to
//! success by `batch` (and remembered by the call site), `range`, `chunked`, and tch's
//! panicking methods under `catch_oom_panics`.
#![allow(clippy::unwrap_used)]

use tch::{Device, Kind, TchError, Tensor};
use tt_adaptive::{Adaptive, Cache, CudaMemory, Policy};

/// Free memory of cuda:0 in MiB, as the adaptive calls see it.
fn free_mib() -> u64 {
    tt_sys::require_cuda();
    let _ = Tensor::zeros([1], (Kind::Float, Device::Cuda(0))); // the CUDA context
    tt_sys::empty_cache().unwrap();
    tt_sys::mem_get_info(0).unwrap().free >> 20
}

/// A batch of `n` MiB on cuda:0: its size, or libtorch's CUDA out-of-memory error.
fn mib_batch(n: usize) -> Result<u64, TchError> {
    let t = Tensor::f_zeros([n as i64, 1 << 18], (Kind::Float, Device::Cuda(0)))?;
    Ok(t.size()[0] as u64)
}

/// Out-of-memory errors counted so far by `a`.
fn ooms(a: &Adaptive) -> u64 {
    a.stats().iter().map(|s| s.ooms).sum()
}

#[test]
fn a_real_cuda_oom_is_retried_and_the_cache_remembers_it() {
    let free = free_mib();
    // Four times the free memory: at least two real OOMs before a size fits.
    let start = 4 * free as usize;
    let run = |a: &Adaptive| a.batch_keyed("mib", start, mib_batch).unwrap();
    let a = Adaptive::new().memory(CudaMemory(0));
    let first = run(&a);
    let ooms_first = ooms(&a);
    assert!(
        ooms_first >= 2 && first < free && first > free / 4,
        "{first} MiB of {free} after {ooms_first} OOMs"
    );
    let second = run(&a);
    let ooms_second = ooms(&a);
    // Without the cache, the same call repeats every OOM of the first.
    let none = Adaptive::new().memory(CudaMemory(0)).cache(Cache::None);
    run(&none);
    let ooms_uncached_first = ooms(&none);
    run(&none);
    let ooms_uncached = ooms(&none) - ooms_uncached_first;
    println!(
        "first {first} MiB ({ooms_first} OOMs), second {second} MiB ({} more); \
         without a cache the second call hit {ooms_uncached}",
        ooms_second - ooms_first
    );
    assert!(second >= first);
    // One OOM of slack: free memory may cross a 256 MiB bucket between the calls.
    assert!(
        ooms_second - ooms_first <= 1,
        "the second call starts from what the first learnt"
    );
    assert!(ooms_uncached >= 2, "without a cache: {ooms_uncached} OOMs");
}

#[test]
fn range_on_cuda_lowers_its_step_and_covers_every_index_once() {
    let free = free_mib() as usize;
    // Each index is 1 MiB on the GPU; twice the free memory in all.
    let end = 2 * free;
    let seen = std::cell::RefCell::new(vec![0u8; end]);
    let a = Adaptive::new().memory(CudaMemory(0)).policy(Policy::Halve);
    a.range(0, end, end, |from, to| {
        let t = Tensor::f_ones(
            [(to - from) as i64, 1 << 18],
            (Kind::Float, Device::Cuda(0)),
        )?;
        // The chunk's sum, on the GPU: a real use of the memory before it is counted.
        let rows = (t.f_sum(Kind::Double)?.double_value(&[]) / f64::from(1 << 18)) as usize;
        assert_eq!(rows, to - from);
        seen.borrow_mut()[from..to].iter_mut().for_each(|s| *s += 1);
        Ok::<_, TchError>(())
    })
    .unwrap();
    assert!(
        seen.borrow().iter().all(|&n| n == 1),
        "every index exactly once"
    );
    let stats = a.stats();
    assert!(ooms(&a) >= 1, "{stats:?}");
    assert!(stats.iter().all(|s| s.size < free), "{stats:?}");
}

#[test]
fn chunked_on_cuda_fills_the_output_as_one_call_would() {
    let free = free_mib();
    // Row i of the work is data[i] times 65 536 weights (256 KiB of float32, twice with
    // the sine): all rows at once need about three times the free memory.
    let cols: i64 = 1 << 16;
    let rows = ((3 * free) << 20) as i64 / (2 * cols * 4);
    let dev = Device::Cuda(0);
    let data = Tensor::arange(rows, (Kind::Float, dev)) * 1e-6;
    let w = Tensor::arange(cols, (Kind::Float, dev)) * 1e-4;
    let out = Tensor::zeros([rows], (Kind::Float, dev));
    let a = Adaptive::new().memory(CudaMemory(0));
    a.chunked(&data, 0, rows as usize, |chunk, from, to| {
        let outer = chunk.f_unsqueeze(1)?.f_mul(&w.f_unsqueeze(0)?)?;
        let sums = outer
            .f_sin()?
            .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Float)?;
        out.f_narrow(0, from as i64, (to - from) as i64)?
            .f_copy_(&sums)
    })
    .unwrap();
    let took = ooms(&a);
    // The reference, in fixed small chunks.
    let step = 4096;
    let want = Tensor::zeros([rows], (Kind::Float, dev));
    for from in (0..rows).step_by(step) {
        let n = step.min((rows - from) as usize) as i64;
        let c = data.narrow(0, from, n);
        let sums = (c.unsqueeze(1) * w.unsqueeze(0)).sin().sum_dim_intlist(
            [1i64].as_slice(),
            false,
            Kind::Float,
        );
        want.narrow(0, from, n).copy_(&sums);
    }
    let diff = (&out - &want).abs().max().double_value(&[]);
    println!("{rows} rows, {took} OOMs, largest difference {diff:e}");
    assert!(
        took >= 1,
        "the whole tensor at once fits: the test proves nothing"
    );
    assert!(diff < 1e-2, "chunked differs from the reference by {diff}");
}

#[test]
fn catch_oom_panics_retries_tchs_panicking_methods_on_a_real_cuda_oom() {
    let free = free_mib() as usize;
    // `Tensor::zeros`, not `f_zeros`: tch panics on the CUDA out-of-memory error.
    let zeros = |n: usize| -> Result<usize, TchError> {
        let t = Tensor::zeros([n as i64, 1 << 18], (Kind::Float, Device::Cuda(0)));
        Ok(t.size()[0] as usize)
    };
    let a = Adaptive::new()
        .memory(CudaMemory(0))
        .policy(Policy::Halve)
        .catch_oom_panics(true);
    let got = a.batch(2 * free, zeros).unwrap();
    assert!(got < free && ooms(&a) >= 1, "{got} MiB of {free}");
    // Not asked: the same panic reaches the caller, unretried.
    let not_asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Adaptive::new().memory(CudaMemory(0)).batch(2 * free, zeros)
    }));
    let message = not_asked.expect_err("an OOM panic is not caught unless asked");
    let text = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(text.contains("out of memory"), "{text}");
    tt_sys::empty_cache().unwrap();
}

/// `Adaptive::new()` keys its cache on the GPU this process trains on (as toma keys on
/// CUDA memory): `DeviceMemory` chooses cuda:0 here and reads what CUDA says is free.
#[test]
fn the_default_cache_key_is_the_training_gpus_free_memory() {
    let free = free_mib();
    let memory = tt_adaptive::DeviceMemory::default();
    assert_eq!(memory.device(), tch::Device::Cuda(0));
    let read = tt_adaptive::MemoryProbe::free_bytes(&memory).expect("CUDA free memory") >> 20;
    assert!(
        read.abs_diff(free) < 1024,
        "read {read} MiB, CUDA says {free} MiB"
    );
}
