//! `reserve_gpu_for_training` on this machine, against real locks held by real
//! processes (util-linux `flock`, as any other cooperating tool would hold them).
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use torchtools::device::{Bytes, Inventory, NvmlStatus};
use torchtools::lock::{GpuKey, GpuSpec, LockDir};
use torchtools::{reserve_gpu_for_training, ReserveError, ReserveOptions};

fn no_gpu() -> bool {
    let inv = Inventory::query();
    !matches!(inv.nvml, NvmlStatus::Available { .. }) || inv.gpus.is_empty()
}

/// One test: the lock directory comes from the process environment.
#[test]
fn reserve_on_this_machine() {
    let tmp = tempfile::tempdir().unwrap();
    // SAFETY (edition 2021: safe fn): this binary's only test sets it before any read.
    std::env::set_var("TORCHTOOLS_LOCK_DIR", tmp.path());
    let dir = LockDir::open(tmp.path()).unwrap();
    let key = GpuSpec::Nvml(0).resolve(&Inventory::query()).unwrap();

    if no_gpu() {
        // Auto on a machine without GPUs: an empty reservation, training goes on (CPU).
        let r = reserve_gpu_for_training(ReserveOptions::default()).unwrap();
        assert!(r.is_empty() && r.ordinal().is_none());
        #[cfg(feature = "tch")]
        assert_eq!(r.device(), tch::Device::Cpu);

        // A named GPU with a fence: a clear error, and no lock left behind.
        let e = reserve_gpu_for_training(ReserveOptions {
            gpu: GpuSpec::Nvml(0),
            training_reserved_bytes: Bytes::gib(1),
            ..ReserveOptions::default()
        })
        .unwrap_err();
        assert!(matches!(e, ReserveError::FenceWithoutNvml { .. }), "{e:?}");
        assert!(e.to_string().contains("fence: false"), "{e}");
        assert!(dir.list().unwrap().iter().all(|s| !s.held));
    }

    // The lock alone works anywhere.
    let options = ReserveOptions {
        gpu: GpuSpec::Nvml(0),
        training_reserved_bytes: Bytes::gib(6),
        fence: false,
        ..ReserveOptions::default()
    };
    let r = reserve_gpu_for_training(options.clone()).unwrap();
    assert_eq!(r.gpus()[0].key, key);
    assert_eq!(r.fenced(), Bytes(0));
    let state = dir
        .list()
        .unwrap()
        .into_iter()
        .find(|s| s.gpu == key)
        .unwrap();
    assert!(state.held);
    assert_eq!(state.holder.unwrap().reserved, Some(Bytes::gib(6)));
    drop(r);
    assert!(
        dir.list().unwrap().iter().all(|s| !s.held),
        "released on drop"
    );

    // Held by another process: non-blocking fails at once, a timeout fails after it.
    let lock_path = tmp.path().join(key.file_name());
    // -o: the lock stays with flock itself (not the shell it runs), so killing flock
    // releases it.
    let mut other = Command::new("flock")
        .arg("-o")
        .arg(&lock_path)
        .args(["-c", "echo held; exec sleep 30"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("util-linux flock");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(other.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let e = reserve_gpu_for_training(ReserveOptions {
        blocking: false,
        ..options.clone()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            ReserveError::Lock(torchtools::lock::Error::WouldBlock { .. })
        ),
        "{e:?}"
    );
    let start = Instant::now();
    let e = reserve_gpu_for_training(ReserveOptions {
        timeout: Some(Duration::from_millis(250)),
        ..options.clone()
    })
    .unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert!(
        matches!(
            e,
            ReserveError::Lock(torchtools::lock::Error::Timeout { .. })
        ),
        "{e:?}"
    );
    other.kill().unwrap();
    other.wait().unwrap();
    let r = reserve_gpu_for_training(ReserveOptions {
        timeout: Some(Duration::from_secs(30)),
        ..options
    })
    .unwrap();
    assert!(matches!(
        r.gpus()[0].key,
        GpuKey::Index(0) | GpuKey::Uuid(_)
    ));
}
