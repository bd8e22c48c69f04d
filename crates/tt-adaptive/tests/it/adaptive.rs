//! The retry engine against a fake memory budget: closures that fail with libtorch's
//! real OOM messages when the size is over a capacity. Deterministic.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tt_adaptive::{Adaptive, AdaptiveError, Cache, MemoryProbe, OomKind, Policy};

const CUDA_OOM: &str =
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB";

/// Work that needs `size` units of a budget of `capacity`; counts its calls.
fn budget(capacity: usize, calls: &AtomicUsize) -> impl FnMut(usize) -> Result<usize, String> + '_ {
    move |size| {
        calls.fetch_add(1, Ordering::Relaxed);
        if size > capacity {
            Err(CUDA_OOM.to_owned())
        } else {
            Ok(size)
        }
    }
}

fn ooms(a: &Adaptive) -> u64 {
    a.stats().iter().map(|s| s.ooms).sum()
}

#[test]
fn halve_is_tomas_rule_and_the_call_site_remembers() {
    let a = Adaptive::new().policy(Policy::Halve);
    let calls = AtomicUsize::new(0);
    let mut sizes = Vec::new();
    for _ in 0..3 {
        sizes.push(a.batch(4096, budget(1000, &calls)).unwrap());
    }
    assert_eq!(sizes, [512, 512, 512]);
    assert_eq!(
        ooms(&a),
        3,
        "the second and third calls start at the cached 512"
    );
    assert_eq!(calls.load(Ordering::Relaxed), 6);
}

#[test]
fn factor_lowers_by_the_factor() {
    let a = Adaptive::new().policy(Policy::Factor(0.9));
    let calls = AtomicUsize::new(0);
    assert_eq!(a.batch(2000, budget(1000, &calls)).unwrap(), 955);
    assert_eq!(ooms(&a), 7); // 2000 1800 1620 1458 1312 1180 1062
}

#[test]
fn search_converges_to_95_percent_within_15_ooms() {
    let a = Adaptive::new(); // Policy::Search is the default
    let calls = AtomicUsize::new(0);
    let mut last = 0;
    for _ in 0..20 {
        last = a.batch(4096, budget(1000, &calls)).unwrap();
    }
    assert!((950..=1000).contains(&last), "{last}");
    assert!(ooms(&a) <= 15, "{} OOMs", ooms(&a));
    // Halving alone would have stayed at 512.
    let h = Adaptive::new().policy(Policy::Halve);
    let halved = (0..20)
        .map(|_| h.batch(4096, budget(1000, &calls)).unwrap())
        .last();
    assert_eq!(halved, Some(512));
}

#[test]
fn growth_doubles_up_to_the_cap_then_searches() {
    let calls = AtomicUsize::new(0);
    let a = Adaptive::new().grow(true).max(700);
    let sizes: Vec<usize> = (0..8)
        .map(|_| a.batch(16, budget(1000, &calls)).unwrap())
        .collect();
    assert_eq!(sizes, [16, 32, 64, 128, 256, 512, 700, 700]);
    assert_eq!(ooms(&a), 0);
    let b = Adaptive::new().grow(true);
    let last = (0..20)
        .map(|_| b.batch(16, budget(300, &calls)).unwrap())
        .last()
        .unwrap();
    assert!((285..=300).contains(&last), "{last}");
}

#[test]
fn below_the_minimum_is_no_fit_with_the_last_error() {
    let calls = AtomicUsize::new(0);
    let a = Adaptive::new().policy(Policy::Halve).min(600);
    match a.batch(4096, budget(500, &calls)) {
        Err(AdaptiveError::NoFit { min, cause, .. }) => {
            assert_eq!(min, 600);
            assert_eq!(cause.as_deref(), Some(CUDA_OOM));
        }
        other => panic!("{other:?}"),
    }
    let e = a.batch(4096, budget(500, &calls)).unwrap_err().to_string();
    assert!(e.contains("minimum size 600"), "{e}");
}

/// A user's own error type: a device error wrapping the driver's message.
#[derive(Debug)]
struct DeviceError {
    message: String,
    cause: std::io::Error,
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeviceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.cause)
    }
}

impl tt_adaptive::OomClassify for DeviceError {
    fn oom_kind(&self) -> Option<OomKind> {
        tt_adaptive::classify_message(&self.message)
    }
}

#[test]
fn the_error_chain_keeps_the_cause() {
    use std::error::Error as _;
    let fail = |message: &str| DeviceError {
        message: message.into(),
        cause: std::io::Error::other("driver says no"),
    };
    // No fit: the message holds the last OOM error's, and the chain goes on below it
    // (its own source), so each cause is printed once.
    let a = Adaptive::new().policy(Policy::Halve).min(64);
    let e = a
        .batch(128, |_| -> Result<(), _> { Err(fail(CUDA_OOM)) })
        .unwrap_err();
    assert!(e.to_string().contains(CUDA_OOM), "{e}");
    let source = e.source().expect("the OOM error's own cause");
    assert_eq!(source.to_string(), "driver says no");
    // The whole chain, as `{:#}` of anyhow or any error reporter prints it.
    let mut chain = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        chain += &format!(": {cause}");
        next = cause.source();
    }
    assert_eq!(chain.matches(CUDA_OOM).count(), 1, "{chain}");
    // Another error passes through transparently: its source is the error's own.
    let e = a
        .batch(128, |_| -> Result<(), _> { Err(fail("dataset missing")) })
        .unwrap_err();
    assert_eq!(e.to_string(), "dataset missing");
    assert_eq!(e.source().unwrap().to_string(), "driver says no");
}

#[test]
fn other_errors_pass_through_untouched_and_are_not_retried() {
    let a = Adaptive::new();
    let calls = AtomicUsize::new(0);
    let r: Result<(), _> = a.batch(512, |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        Err("shape '[2, 3]' is invalid for input of size 7".to_owned())
    });
    match r {
        Err(AdaptiveError::Failed(e)) => {
            assert_eq!(e, "shape '[2, 3]' is invalid for input of size 7")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

#[test]
fn range_processes_every_index_exactly_once_through_ooms() {
    for policy in [Policy::Halve, Policy::Factor(0.7), Policy::Search] {
        let a = Adaptive::new().policy(policy);
        let mut seen = vec![0u32; 10_000];
        let mut failures = 0;
        a.range(0, 10_000, 4096, |from, to| {
            if to - from > 300 {
                failures += 1;
                return Err(CUDA_OOM.to_owned());
            }
            for s in &mut seen[from..to] {
                *s += 1;
            }
            Ok(())
        })
        .unwrap();
        assert!(seen.iter().all(|&c| c == 1), "{policy:?}");
        assert!(failures > 0);
    }
}

#[test]
fn call_sites_and_memory_buckets_are_separate_entries() {
    struct Probe(Arc<AtomicU64>);
    impl MemoryProbe for Probe {
        fn free_bytes(&self) -> Option<u64> {
            Some(self.0.load(Ordering::Relaxed))
        }
    }
    let free = Arc::new(AtomicU64::new(10 << 30));
    let a = Adaptive::new()
        .policy(Policy::Halve)
        .memory(Probe(Arc::clone(&free)));
    let calls = AtomicUsize::new(0);
    // One call site: every call goes through this closure's line.
    let site_one = |a: &Adaptive| a.batch(1024, budget(100, &calls)).unwrap();
    assert_eq!(site_one(&a), 64);
    assert_eq!(site_one(&a), 64); // same site: starts at the cached 64
    assert_eq!(ooms(&a), 4);
    let other_site = a.batch(1024, budget(100, &calls)).unwrap();
    assert_eq!(other_site, 64);
    assert_eq!(a.stats().len(), 2, "{:?}", a.stats());
    assert_eq!(ooms(&a), 8, "a new call site starts over");
    // Free memory moves by a bucket (256 MiB): a new key for the same site.
    free.store((10 << 30) - (512 << 20), Ordering::Relaxed);
    a.refresh_memory();
    assert_eq!(site_one(&a), 64);
    assert_eq!(ooms(&a), 12);
    assert_eq!(a.stats().len(), 3);
    // The global cache ignores sites and memory.
    let g = Adaptive::new().policy(Policy::Halve).cache(Cache::Global);
    for _ in 0..2 {
        g.batch(1024, budget(100, &calls)).unwrap();
    }
    assert_eq!(ooms(&g), 4);
    let n = Adaptive::new().policy(Policy::Halve).cache(Cache::None);
    for _ in 0..2 {
        n.batch(1024, budget(100, &calls)).unwrap();
    }
    assert_eq!(ooms(&n), 8, "no cache: every call starts at 1024");
}

#[test]
fn the_oom_hook_can_free_memory_and_agreement_lowers_the_start() {
    let capacity = Arc::new(AtomicUsize::new(100));
    let cap = Arc::clone(&capacity);
    let a = Adaptive::new().on_oom(move |kind, size| {
        assert_eq!(kind, OomKind::Cuda);
        // A fence hands memory back: the same size then fits.
        cap.store(size, Ordering::Relaxed);
        true
    });
    let got = a
        .batch(512, |n| {
            if n > capacity.load(Ordering::Relaxed) {
                Err(CUDA_OOM.to_owned())
            } else {
                Ok(n)
            }
        })
        .unwrap();
    assert_eq!(got, 512);
    let calls = AtomicUsize::new(0);
    let b = Adaptive::new().agree(|n| n.min(128));
    assert_eq!(b.batch(512, budget(1000, &calls)).unwrap(), 128);
}

#[test]
fn oom_panics_are_caught_only_when_asked() {
    let a = Adaptive::new().catch_oom_panics(true);
    let got = a
        .batch(1024, |n| -> Result<usize, String> {
            if n > 100 {
                panic!("Torch(\"{CUDA_OOM}\")");
            }
            Ok(n)
        })
        .unwrap();
    assert_eq!(got, 64);
    // Another panic propagates.
    let other = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        a.batch(8, |_| -> Result<(), String> {
            panic!("index out of range")
        })
    }));
    assert!(other.is_err());
    // Not asked (the default): an OOM panic propagates at the first try, unretried.
    let tries = std::sync::atomic::AtomicUsize::new(0);
    let not_asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Adaptive::new().batch(1024, |_| -> Result<usize, String> {
            tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            panic!("Torch(\"{CUDA_OOM}\")");
        })
    }));
    let message = not_asked.expect_err("an OOM panic is not caught unless asked");
    let text = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(text.contains("out of memory"), "{text}");
    assert_eq!(tries.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A fixed amount of free memory: one cache bucket whatever else runs on the machine.
struct Fixed;
impl MemoryProbe for Fixed {
    fn free_bytes(&self) -> Option<u64> {
        Some(8 << 30)
    }
}

/// Work over a budget that records every size tried.
fn recorded(
    capacity: usize,
    tried: &mut Vec<usize>,
) -> impl FnMut(usize) -> Result<usize, String> + '_ {
    move |size| {
        tried.push(size);
        if size > capacity {
            Err(CUDA_OOM.to_owned())
        } else {
            Ok(size)
        }
    }
}

#[test]
fn no_cache_lowers_like_toma_on_every_call_whatever_the_policy() {
    // toma's NoBatchsizeCache: every call starts at the initial size and halves.
    for policy in [Policy::Search, Policy::Halve] {
        let a = Adaptive::new().policy(policy).cache(Cache::None);
        for call in 0..8 {
            let mut tried = Vec::new();
            let got = a.batch(512, recorded(100, &mut tried)).unwrap();
            assert_eq!(
                (got, tried.as_slice()),
                (64, [512, 256, 128, 64].as_slice()),
                "{policy:?}, call {call}: nothing learned by earlier calls changes this one"
            );
        }
        assert_eq!(ooms(&a), 8 * 3, "{policy:?}: 3 OOMs a call, as toma");
        assert_eq!(a.stats()[0].calls, 8);
    }
    // Within one range call the search may go back up; the next call starts over.
    let a = Adaptive::new().cache(Cache::None);
    for _ in 0..2 {
        let mut tried = Vec::new();
        let mut covered = 0;
        a.range(0, 2000, 512, |from, to| {
            tried.push(to - from);
            if to - from > 100 {
                return Err(CUDA_OOM.to_owned());
            }
            covered += to - from;
            Ok(())
        })
        .unwrap();
        assert_eq!(covered, 2000);
        assert_eq!(tried[..4], [512, 256, 128, 64], "each call starts at 512");
        assert!(
            tried[4..].iter().any(|&n| n > 64 && n <= 100),
            "searched back up within the call: {tried:?}"
        );
    }
}

#[test]
fn a_helper_shared_by_models_keeps_one_entry_per_key() {
    // One helper, one call site, two models of different sizes.
    fn helper(a: &Adaptive, key: Option<&str>, capacity: usize, tried: &mut Vec<usize>) -> usize {
        let work = recorded(capacity, tried);
        match key {
            Some(k) => a.batch_keyed(k, 1024, work).unwrap(),
            None => a.batch(1024, work).unwrap(),
        }
    }
    let run = |key_a: Option<&str>, key_b: Option<&str>| {
        let a = Adaptive::new().policy(Policy::Halve).memory(Fixed);
        let mut first = Vec::new();
        helper(&a, key_a, 1000, &mut first);
        helper(&a, key_b, 100, &mut Vec::new());
        let mut again = Vec::new();
        let got = helper(&a, key_a, 1000, &mut again);
        (got, again, a.stats())
    };
    // By call site alone, model A starts from model B's size.
    let (shared, _, stats) = run(None, None);
    assert_eq!(shared, 64);
    assert_eq!(stats.len(), 1);
    // With keys each model has its entry: A starts from its own 512 and needs no retry.
    let (own, tried, stats) = run(Some("model-a"), Some("model-b"));
    assert_eq!((own, tried), (512, vec![512]));
    let sites: Vec<&str> = stats.iter().map(|s| s.site.as_str()).collect();
    assert_eq!(sites, ["model-a", "model-b"]);
    assert_eq!(stats.iter().map(|s| s.size).collect::<Vec<_>>(), [512, 64]);
    // Keys work for ranges too, and under the global cache.
    let g = Adaptive::new().policy(Policy::Halve).cache(Cache::Global);
    for (key, cap) in [("a", 1000), ("b", 100)] {
        g.range_keyed(key, 0, 3000, 1024, |from, to| {
            if to - from > cap {
                Err(CUDA_OOM.to_owned())
            } else {
                Ok(())
            }
        })
        .unwrap();
    }
    let sizes: Vec<(String, usize)> = g.stats().into_iter().map(|s| (s.site, s.size)).collect();
    assert_eq!(sizes, [("a".to_owned(), 512), ("b".to_owned(), 64)]);
}

/// Free memory as a fixed figure, counting how often it is read.
struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);
impl MemoryProbe for Counting {
    fn free_bytes(&self) -> Option<u64> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some(8 << 30)
    }
}

#[test]
fn free_memory_is_read_at_most_once_a_second_and_again_after_an_oom() {
    use std::sync::atomic::Ordering::SeqCst;
    let reads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = Adaptive::new().memory(Counting(reads.clone()));
    let start = std::time::Instant::now();
    for _ in 0..2000 {
        a.batch(64, |n| -> Result<usize, String> { Ok(n) }).unwrap();
    }
    // The success path's hot loop: one read per second elapsed at most (plus the
    // first), however long 2000 calls took on this machine.
    let allowed = start.elapsed().as_secs() as usize + 1;
    let on_success = reads.load(SeqCst);
    assert!(
        (1..=allowed).contains(&on_success),
        "{on_success} reads in {:?}",
        start.elapsed()
    );
    // An OOM forces a fresh read (the memory free changed).
    let before = reads.load(SeqCst);
    a.batch(64, |n| -> Result<usize, String> {
        if n > 32 {
            Err(CUDA_OOM.to_owned())
        } else {
            Ok(n)
        }
    })
    .unwrap();
    assert!(reads.load(SeqCst) > before, "an OOM re-reads free memory");
}
