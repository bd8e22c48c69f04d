//! `reserve_on` over GPUs given by a backend other than NVML (a fixed inventory): the
//! choice of `auto`, named GPUs and the locks, on a machine without GPUs. (One test:
//! the lock directory comes from the process environment.)
#![allow(clippy::unwrap_used)]

use tt_device::{Bytes, GpuInfo, Inventory, NvmlStatus};
use tt_lock::{GpuKey, GpuSpec};
use tt_reserve::{reserve_on, Error, ReserveOptions};

fn machine(free_gib: &[u64]) -> Inventory {
    Inventory {
        nvml: NvmlStatus::Available {
            driver_version: "a test's".into(),
        },
        gpus: free_gib
            .iter()
            .enumerate()
            .map(|(i, free)| GpuInfo {
                nvml_index: i as u32,
                uuid: format!("GPU-{i:08}-aaaa-bbbb-cccc-dddddddddddd"),
                name: "Test GPU".into(),
                total: Bytes::gib(80),
                free: Bytes::gib(*free),
                used: Bytes::gib(80 - free),
                utilization: None,
                processes: Vec::new(),
                mig: Vec::new(),
            })
            .collect(),
        errors: Vec::new(),
    }
}

#[test]
fn auto_and_named_gpus_come_from_the_backend() {
    let tmp = tempfile::tempdir().unwrap();
    // SAFETY (edition 2021: safe fn): this binary's only test sets them before any read.
    std::env::set_var("TORCHTOOLS_LOCK_DIR", tmp.path());
    std::env::remove_var("CUDA_VISIBLE_DEVICES");
    let gpus = machine(&[10, 70, 40]);
    let lock_only = |gpus: Vec<GpuSpec>, count: Option<usize>| ReserveOptions {
        gpus,
        count,
        fence: false,
        blocking: false,
        ..ReserveOptions::default()
    };
    // auto x2: the two with the most free memory, most free first.
    let two = reserve_on(&gpus, lock_only(vec![GpuSpec::Auto], Some(2)), |_| {}).unwrap();
    let key = |i: u32| GpuKey::of_uuid(&format!("GPU-{i:08}-aaaa-bbbb-cccc-dddddddddddd"));
    let keys: Vec<&GpuKey> = two.gpus().iter().map(|g| &g.key).collect();
    assert_eq!(keys, [&key(1), &key(2)]);
    // GPU 1 is held (by this process): a named request for it is told so at once...
    let e = reserve_on(&gpus, lock_only(vec![GpuSpec::Nvml(1)], None), |_| {}).unwrap_err();
    assert!(
        matches!(e, Error::Lock(tt_lock::Error::AlreadyHeld { ref gpu }) if *gpu == key(1)),
        "{e:?}"
    );
    // ...and auto takes what is left.
    let last = reserve_on(&gpus, lock_only(vec![GpuSpec::Auto], None), |_| {}).unwrap();
    assert_eq!(last.gpus()[0].key, key(0));
    // The locks are the GPUs' own files, as NVML's GPUs would have them.
    assert!(tmp.path().join(key(0).file_name()).exists());
    // A GPU the backend does not list is an error before anything is taken.
    let e = reserve_on(&gpus, lock_only(vec![GpuSpec::Nvml(7)], None), |_| {}).unwrap_err();
    assert!(matches!(e, Error::Lock(_)) || e.is_bad_request(), "{e:?}");
}
