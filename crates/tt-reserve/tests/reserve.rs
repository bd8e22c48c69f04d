//! `tt_reserve::reserve` (the Python torchtools' `reserve_gpu_for_training`) on this machine, against real locks held by real
//! processes (util-linux `flock`, as any other cooperating tool would hold them).
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tt_device::{Bytes, Inventory, NvmlStatus};
use tt_lock::{GpuKey, GpuSpec, LockDir};
use tt_reserve::{reserve, reserve_with, Error, ReserveOptions};

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
        let r = reserve(ReserveOptions::default()).unwrap();
        assert!(r.is_empty() && r.ordinal().is_none());
        #[cfg(feature = "tch")]
        assert_eq!(r.device().unwrap(), tch::Device::Cpu);

        // A named GPU with a fence: a clear error, and no lock left behind.
        let e = reserve(ReserveOptions {
            gpus: vec![GpuSpec::Nvml(0)],
            training_reserved_bytes: Bytes::gib(1),
            ..ReserveOptions::default()
        })
        .unwrap_err();
        assert!(matches!(e, Error::FenceWithoutNvml { .. }), "{e:?}");
        assert!(e.to_string().contains("fence: false"), "{e}");
        assert!(dir.list().unwrap().iter().all(|s| !s.held));

        // The index lock alone: scripts rely on it, but it is no CUDA device, and the
        // reservation never says "CPU" for a GPU it holds.
        let r = reserve(ReserveOptions {
            gpus: vec![GpuSpec::Nvml(0)],
            fence: false,
            ..ReserveOptions::default()
        })
        .unwrap();
        assert_eq!(r.gpus()[0].key, GpuKey::Index(0));
        assert_eq!(r.ordinal(), None);
        #[cfg(feature = "tch")]
        {
            let e = r.device().unwrap_err();
            assert!(matches!(e, Error::NoCudaDevice { .. }), "{e:?}");
            assert!(e.to_string().contains("not visible to CUDA"), "{e}");
        }
        drop(r);
    }

    // Contradicting options: refused before any lock is taken.
    for (options, needle) in [
        (
            ReserveOptions {
                gpus: vec![GpuSpec::Auto, GpuSpec::Nvml(0)],
                fence: false,
                ..ReserveOptions::default()
            },
            "auto cannot be combined",
        ),
        (
            ReserveOptions {
                gpus: vec![GpuSpec::Nvml(0)],
                count: Some(2),
                fence: false,
                ..ReserveOptions::default()
            },
            "a count of 2 but 1 GPU(s) named",
        ),
        (
            ReserveOptions {
                count: Some(0),
                ..ReserveOptions::default()
            },
            "a count of 0",
        ),
        (
            ReserveOptions {
                gpus: vec![],
                ..ReserveOptions::default()
            },
            "no GPU named",
        ),
    ] {
        let e = reserve(options).unwrap_err();
        assert!(e.is_bad_request() && !e.is_busy(), "{e:?}");
        assert!(e.to_string().contains(needle), "{e}");
        assert!(dir.list().unwrap().iter().all(|s| !s.held));
    }

    // The lock alone works anywhere.
    let options = ReserveOptions {
        gpus: vec![GpuSpec::Nvml(0)],
        training_reserved_bytes: Bytes::gib(6),
        fence: false,
        ..ReserveOptions::default()
    };
    let r = reserve(options.clone()).unwrap();
    assert_eq!(r.gpus()[0].key, key);
    assert_eq!(r.fenced(), Bytes(0));
    let state = dir
        .list()
        .unwrap()
        .into_iter()
        .find(|s| s.gpu == key)
        .unwrap();
    assert!(state.held);
    assert_eq!(state.holder.unwrap().who.reserved, Some(Bytes::gib(6)));
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
    let e = reserve(ReserveOptions {
        blocking: false,
        ..options.clone()
    })
    .unwrap_err();
    assert!(
        matches!(e, Error::Lock(tt_lock::Error::WouldBlock { .. })),
        "{e:?}"
    );
    let start = Instant::now();
    let mut waited = None;
    let e = reserve_with(
        ReserveOptions {
            timeout: Some(Duration::from_millis(250)),
            ..options.clone()
        },
        |w| waited = Some(w.to_string()),
    )
    .unwrap_err();
    let waited = waited.expect("the observer hears about the wait");
    assert!(
        waited.contains("is locked by") && waited.contains("waiting (at most 250ms)"),
        "{waited}"
    );
    assert!(e.is_busy(), "{e:?}");
    assert!(start.elapsed() >= Duration::from_millis(250));
    assert!(
        matches!(e, Error::Lock(tt_lock::Error::Timeout { .. })),
        "{e:?}"
    );
    other.kill().unwrap();
    other.wait().unwrap();
    let r = reserve(ReserveOptions {
        timeout: Some(Duration::from_secs(30)),
        ..options
    })
    .unwrap();
    assert!(matches!(
        r.gpus()[0].key,
        GpuKey::Index(0) | GpuKey::Uuid(_)
    ));
}
