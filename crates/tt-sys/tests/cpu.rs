//! The shim's contract on any machine: CUDA is either usable or reported with a
//! reason, and allocator calls without CUDA are typed errors, never crashes.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::path::Path;

#[test]
fn libtorch_version_matches_the_linked_library() {
    assert_eq!(tt_sys::libtorch_version(), "2.11.0");
    let dir = tt_sys::libtorch_lib_dir().expect("libc10.so is loaded in a tch binary");
    assert!(
        dir.join("libtorch_cpu.so").exists(),
        "no libtorch_cpu.so in {}",
        dir.display()
    );
}

#[test]
fn cuda_is_usable_or_says_why_and_allocator_calls_agree() {
    // A tensor op first, so libtorch is really initialised.
    let t = tch::Tensor::arange(10, (tch::Kind::Float, tch::Device::Cpu));
    assert_eq!(t.sum(tch::Kind::Float).double_value(&[]), 45.0);

    match tt_sys::ensure_cuda_loaded() {
        Ok(info) => {
            assert!(info.device_count > 0);
            assert!(
                tch::Cuda::is_available(),
                "loaded libtorch_cuda but tch still sees no CUDA"
            );
            assert!(tt_sys::device_stats(0).is_ok());
            let err = tt_sys::device_stats(info.device_count).unwrap_err();
            assert!(
                matches!(err, tt_sys::Error::DeviceOutOfRange { .. }),
                "{err}"
            );
        }
        Err(why) => {
            let msg = why.to_string();
            // The wheel is a CUDA build, so the reason on a machine without a GPU is
            // the driver, not a CPU-only libtorch.
            let wheel_has_cuda = tt_sys::libtorch_lib_dir()
                .unwrap()
                .join("libtorch_cuda.so")
                .exists();
            if wheel_has_cuda && !Path::new("/dev/nvidia0").exists() {
                assert!(
                    matches!(why, tt_sys::CudaUnavailable::NoDriver { .. }),
                    "{msg}"
                );
                assert!(msg.contains("libcuda.so.1"), "{msg}");
            }
            assert!(!tch::Cuda::is_available());
            for result in [
                tt_sys::device_stats(0).map(|_| ()),
                tt_sys::empty_cache(),
                tt_sys::reset_peak_stats(0),
                tt_sys::mem_get_info(0).map(|_| ()),
            ] {
                let err = result.expect_err("allocator call succeeded without CUDA");
                assert_eq!(err, tt_sys::Error::CudaUnavailable(why.clone()));
                assert!(
                    err.to_string().starts_with("CUDA is not available: "),
                    "{err}"
                );
            }
        }
    }
}

#[test]
fn ensure_cuda_loaded_is_cached_and_cheap() {
    let first = tt_sys::ensure_cuda_loaded().map(|i| i.device_count);
    let start = std::time::Instant::now();
    for _ in 0..1000 {
        assert_eq!(tt_sys::ensure_cuda_loaded().map(|i| i.device_count), first);
    }
    // Generous bound: a cached lookup, not a dlopen per call.
    assert!(start.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn test_binaries_find_libtorch_through_their_runpath() {
    // This binary was started by cargo without LD_LIBRARY_PATH (see .cargo/config.toml):
    // the libtorch it runs with must be the one tt-sys found, reached through the
    // RUNPATH its build script wrote. Checked in the process itself, no tool needed.
    let dir = tt_sys::libtorch_lib_dir().unwrap().canonicalize().unwrap();
    let through_env = std::env::var_os("LD_LIBRARY_PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| d.canonicalize().ok().as_deref() == Some(&*dir))
    });
    assert!(
        !through_env,
        "LD_LIBRARY_PATH names {}: this test must run without it to check the RUNPATH",
        dir.display()
    );
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let loaded: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.contains("libtorch_cpu.so") || p.contains("libc10.so"))
        .collect();
    assert!(!loaded.is_empty(), "libtorch is not loaded:\n{maps}");
    for path in loaded {
        let parent = std::path::Path::new(path)
            .parent()
            .unwrap()
            .canonicalize()
            .unwrap();
        assert_eq!(
            parent,
            dir,
            "{path} was loaded from elsewhere than {}",
            dir.display()
        );
    }
    // And the RUNPATH itself, when binutils is there to show it.
    let exe = std::env::current_exe().unwrap();
    if let Ok(out) = std::process::Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
    {
        let dynamic = String::from_utf8_lossy(&out.stdout);
        let runpath = dynamic
            .lines()
            .find(|l| l.contains("(RUNPATH)"))
            .unwrap_or("");
        let dirs: Vec<_> = runpath
            .rsplit('[')
            .next()
            .unwrap_or("")
            .trim_end_matches(']')
            .split(':')
            .collect();
        assert!(
            dirs.iter()
                .any(|d| std::path::Path::new(d).canonicalize().ok().as_deref() == Some(&*dir)),
            "no RUNPATH to {} in:\n{dynamic}",
            dir.display()
        );
    }
}

/// The child of the preload test: what `ensure_cuda_loaded` says.
#[test]
#[ignore = "a child process's entry point, run by the preload test"]
fn preload_child() {
    if std::env::var_os("TT_SYS_PRELOAD_CHILD").is_none() {
        return;
    }
    match tt_sys::ensure_cuda_loaded() {
        Ok(info) => println!("\n@@loaded {}", info.device_count),
        Err(e) => println!("\n@@error {e}"),
    }
}

#[test]
fn a_bad_torchtools_cuda_preload_is_an_error_naming_it() {
    let said = |value: &str| {
        let out = tt_testkit::rerun("preload_child")
            .env("TT_SYS_PRELOAD_CHILD", "1")
            .env("TORCHTOOLS_CUDA_PRELOAD", value)
            .output()
            .unwrap();
        tt_testkit::assert_ran_one(&out);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find_map(|l| l.split_once("@@").map(|(_, rest)| rest.to_owned()))
            .unwrap_or_else(|| panic!("{text}"))
    };
    let bad = said("yes");
    assert!(
        bad.starts_with("error TORCHTOOLS_CUDA_PRELOAD=\"yes\" is not 0 or 1"),
        "{bad}"
    );
    // 0 and 1 are accepted: whatever this machine then says, it is not about them.
    for ok in ["0", "1"] {
        let said = said(ok);
        assert!(!said.contains("TORCHTOOLS_CUDA_PRELOAD=\""), "{ok}: {said}");
    }
}
