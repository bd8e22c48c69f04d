//! The process-wide defaults of `Adaptive::new()`: a test that changes one does so in a
//! child process of its own (they are global to the process, which the other tests of
//! this binary share).

use tt_adaptive::{default_cache, set_default_cache, Adaptive, Cache};

/// toma's `DEFAULT_CACHE_TYPE`: set once, every later `Adaptive::new()` starts with it
/// (in a process of its own: the default is the process's).
#[test]
fn the_default_cache_is_set_for_the_process() {
    let out = tt_testkit::rerun("child_default_cache")
        .env("TT_ADAPTIVE_DEFAULTS_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "a child process's entry point, run by the default cache test"]
fn child_default_cache() {
    if std::env::var_os("TT_ADAPTIVE_DEFAULTS_CHILD").is_none() {
        return;
    }
    assert_eq!(default_cache(), Cache::CallSite);
    let step = |n: usize| -> Result<usize, String> {
        if n > 100 {
            Err("CUDA out of memory. Tried to allocate".into())
        } else {
            Ok(n)
        }
    };
    set_default_cache(Cache::None);
    assert_eq!(default_cache(), Cache::None);
    // Nothing remembered between calls: each call lowers from 512 again (3 OOMs each).
    let adaptive = Adaptive::new();
    for _ in 0..2 {
        assert_eq!(adaptive.batch(512, step).unwrap(), 64);
    }
    let ooms: u64 = adaptive.stats().iter().map(|s| s.ooms).sum();
    assert_eq!(ooms, 6);
    // An instance may still choose.
    let remembering = Adaptive::new().cache(Cache::CallSite);
    for _ in 0..2 {
        remembering.batch(512, step).unwrap();
    }
    let ooms: u64 = remembering.stats().iter().map(|s| s.ooms).sum();
    assert!(ooms < 6, "{ooms}");
    set_default_cache(Cache::CallSite);
}

/// Without a GPU the default cache key is the CPU's free memory (with a GPU, the GPU
/// test checks CUDA's).
#[cfg(feature = "tch")]
#[test]
fn the_default_cache_key_follows_the_selected_device() {
    let memory = tt_adaptive::DeviceMemory::default();
    assert_eq!(memory.device(), tt_device::select().unwrap());
    if memory.device() == tch::Device::Cpu {
        let cpu = tt_adaptive::available_cpu_memory().unwrap();
        let read = tt_adaptive::MemoryProbe::free_bytes(&memory).unwrap();
        assert!(
            read.abs_diff(cpu) < cpu / 10,
            "read {read}, the CPU has {cpu} free"
        );
    }
}
