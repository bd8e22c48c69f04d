//! `torch.randperm(n, generator=g)` on the CPU, bit for bit.
//!
//! ATen (`randperm_cpu`, TensorFactories.cpp) has two algorithms:
//! - `n < u32::MAX / 20` (214,748,363 and below): identity, then for `i` in
//!   `0..n-1` swap `r[i]` with `r[i + random() % (n - i)]` (a 32-bit draw);
//! - larger `n`: the "inside-out" Fisher–Yates: for `i` in `0..n`,
//!   `z = random64() % (i + 1)`, `r[i] = r[z]`, `r[z] = i`.

use crate::mt19937::Mt19937;

/// The size from which ATen switches to the 64-bit inside-out algorithm.
pub const LARGE_RANDPERM: u64 = (u32::MAX / 20) as u64;

/// Storage for permutation entries: `u32` when `n` fits (half the memory traffic).
pub(crate) trait PermIndex: Copy + Send + 'static {
    fn from_u64(v: u64) -> Self;
    fn to_u64(self) -> u64;
}

impl PermIndex for u32 {
    #[inline]
    fn from_u64(v: u64) -> Self {
        v as u32
    }
    #[inline]
    fn to_u64(self) -> u64 {
        self as u64
    }
}

impl PermIndex for u64 {
    #[inline]
    fn from_u64(v: u64) -> Self {
        v
    }
    #[inline]
    fn to_u64(self) -> u64 {
        self
    }
}

/// How many draws are computed ahead of the swaps, so that the swaps' random memory
/// accesses can be prefetched and overlap.
const AHEAD: usize = 32;

#[inline(always)]
// Left out of mutation testing: a CPU cache hint with no observable effect (its worth
// is measured by the sampler benchmark).
#[cfg_attr(mutants, mutants::skip)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults and has no visible effect,
    // whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Writes `torch.randperm(n)` for a generator seeded with `seed` into `out`.
pub(crate) fn randperm_into<T: PermIndex>(n: u64, seed: u64, out: &mut Vec<T>) {
    out.clear();
    let mut gen = Mt19937::new(seed);
    if n < LARGE_RANDPERM {
        small(n as usize, &mut gen, out);
    } else {
        large(n as usize, &mut gen, out);
    }
}

/// From this size on, targets are drawn on a second thread while this one swaps.
const PIPELINE_MIN: usize = 1 << 20;
/// Targets per message between the threads.
const CHUNK: usize = 1 << 14;

fn small<T: PermIndex>(n: usize, gen: &mut Mt19937, out: &mut Vec<T>) {
    out.extend((0..n as u64).map(T::from_u64));
    if n < 2 {
        return;
    }
    let last = n - 1; // the swaps run for i in 0..n-1
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get());
    if n >= PIPELINE_MIN && threads > 1 && small_pipelined(n, last, gen, out.as_mut_slice()) {
        return;
    }
    let r = out.as_mut_slice();
    let mut targets = [0usize; AHEAD];
    let mut i = 0;
    while i < last {
        let batch = AHEAD.min(last - i);
        for (k, t) in targets[..batch].iter_mut().enumerate() {
            // n - i < 2^32 here, so a 32-bit remainder equals ATen's 64-bit one.
            let span = (n - i - k) as u32;
            *t = i + k + (gen.next_u32() % span) as usize;
            prefetch(r.as_ptr().wrapping_add(*t));
        }
        for (k, &t) in targets[..batch].iter().enumerate() {
            r.swap(i + k, t);
        }
        i += batch;
    }
}

/// The same swaps as [`small`], with the draws (MT19937 and the remainder) made on
/// a scoped helper thread and handed over in chunks; the swaps, bound by memory
/// latency, stay here and prefetch their targets ahead.
/// `false` (with nothing drawn or swapped) where no thread can be had: an
/// address-space or pids limit; the caller then does it all on its own thread.
fn small_pipelined<T: PermIndex>(n: usize, last: usize, gen: &mut Mt19937, r: &mut [T]) -> bool {
    use std::sync::mpsc::sync_channel;
    let (full_tx, full_rx) = sync_channel::<Vec<u32>>(4);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u32>>(6);
    for _ in 0..6 {
        // Cannot fail: the receiver is alive and the channel has room for all six.
        let _ = empty_tx.send(Vec::with_capacity(CHUNK));
    }
    std::thread::scope(|scope| {
        let helper = tt_device::spawn_scoped(scope, "tt-sampler-draws", move || {
            let mut i = 0;
            while i < last {
                let Ok(mut buf) = empty_rx.recv() else { return };
                buf.clear();
                let end = (i + CHUNK).min(last);
                // n - i < 2^32 here, so a 32-bit remainder equals ATen's 64-bit one;
                // the target i + z < n < 2^32 fits a u32 too.
                buf.extend(
                    (i..end).map(|j| (j as u32).wrapping_add(gen.next_u32() % (n - j) as u32)),
                );
                i = end;
                if full_tx.send(buf).is_err() {
                    return;
                }
            }
        });
        if helper.is_err() {
            return false;
        }
        let mut i = 0;
        for buf in full_rx.iter() {
            for (k, &t) in buf.iter().enumerate() {
                if let Some(&ahead) = buf[k..].get(AHEAD) {
                    prefetch(r.as_ptr().wrapping_add(ahead as usize));
                }
                r.swap(i + k, t as usize);
            }
            i += buf.len();
            // The helper may have finished and dropped its receiver: nothing to recycle.
            let _ = empty_tx.send(buf);
        }
        true
    })
}

fn large<T: PermIndex>(n: usize, gen: &mut Mt19937, out: &mut Vec<T>) {
    out.resize(n, T::from_u64(0));
    let r = out.as_mut_slice();
    for i in 0..n {
        let z = (gen.next_u64() % (i as u64 + 1)) as usize;
        r[i] = r[z];
        r[z] = T::from_u64(i as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(n: u64, seed: u64) -> Vec<u64> {
        let mut v: Vec<u32> = Vec::new();
        randperm_into(n, seed, &mut v);
        v.into_iter().map(u64::from).collect()
    }

    #[test]
    fn is_a_permutation_and_deterministic() {
        for n in [0u64, 1, 2, 3, 31, 32, 33, 1000] {
            let p = perm(n, 42);
            let mut sorted = p.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            assert_eq!(p, perm(n, 42));
        }
        assert_ne!(perm(100, 1), perm(100, 2));
    }

    /// ATen's 32-bit algorithm written plainly: one draw, one swap, in order.
    fn sequential(n: usize, seed: u64) -> Vec<u64> {
        let mut seq: Vec<u64> = (0..n as u64).collect();
        let mut gen = Mt19937::new(seed);
        for i in 0..n.saturating_sub(1) {
            let z = i + (gen.next_u32() % (n - i) as u32) as usize;
            seq.swap(i, z);
        }
        seq
    }

    #[test]
    fn small_sizes_are_the_plain_swaps() {
        // Two elements are swapped by their one draw (for some seeds), as in ATen.
        for n in 0..70 {
            for seed in 0..8 {
                assert_eq!(
                    perm(n as u64, seed),
                    sequential(n, seed),
                    "n = {n}, seed {seed}"
                );
            }
        }
    }

    #[test]
    fn the_pipelined_swaps_equal_the_sequential_ones() {
        let n = PIPELINE_MIN + 12_345;
        assert_eq!(perm(n as u64, 3), sequential(n, 3));
    }

    #[test]
    fn without_a_thread_the_permutation_is_made_here_and_is_the_same() {
        let n = PIPELINE_MIN as u64 + 7;
        let threaded = perm(n, 11);
        tt_device::refuse_threads(true);
        let here = perm(n, 11);
        tt_device::refuse_threads(false);
        assert!(
            here == threaded,
            "another permutation without the helper thread"
        );
    }

    #[test]
    fn u32_and_u64_storage_agree() {
        let mut a: Vec<u32> = Vec::new();
        let mut b: Vec<u64> = Vec::new();
        randperm_into(5000, 9, &mut a);
        randperm_into(5000, 9, &mut b);
        // Read back as the sampler reads its share (`to_u64`): the same indices.
        assert_eq!(
            a.iter().map(|x| x.to_u64()).collect::<Vec<_>>(),
            b.iter().map(|y| y.to_u64()).collect::<Vec<_>>()
        );
        assert_eq!(b.iter().max(), Some(&4999));
    }
}
