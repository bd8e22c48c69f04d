//! With libtorch: `chunked` through OOMs, tch's errors classified, and a real CPU
//! out-of-memory (under an address-space limit, in a child process) retried to success.

use tch::{Device, Kind, TchError, Tensor};
use tt_adaptive::{set_cpu_memory_limit, Adaptive, AdaptiveError, OomClassify, OomKind, Policy};

#[test]
fn chunked_fills_every_row_exactly_once_through_ooms() {
    let data = Tensor::arange(10_000, (Kind::Float, Device::Cpu)).reshape([10_000, 1]);
    let out = Tensor::zeros([10_000, 1], (Kind::Float, Device::Cpu));
    let visits = Tensor::zeros([10_000], (Kind::Int64, Device::Cpu));
    let mut ooms = 0;
    Adaptive::new()
        .chunked(&data, 0, 4096, |chunk, from, to| -> Result<(), TchError> {
            if to - from > 300 {
                ooms += 1;
                return Err(TchError::Torch(
                    "CUDA out of memory. Tried to allocate 1.00 GiB".into(),
                ));
            }
            out.f_narrow(0, from as i64, (to - from) as i64)?
                .f_copy_(&chunk.f_mul_scalar(2)?)?;
            let _ = visits
                .f_narrow(0, from as i64, (to - from) as i64)?
                .f_add_scalar_(1)?;
            Ok(())
        })
        .unwrap();
    assert!(ooms > 0);
    assert!(out.equal(&(data * 2)));
    assert_eq!(visits.min().int64_value(&[]), 1);
    assert_eq!(visits.max().int64_value(&[]), 1);
    let e = Adaptive::new()
        .chunked(&out, 3, 8, |_, _, _| -> Result<(), TchError> { Ok(()) })
        .unwrap_err();
    assert!(
        matches!(e, AdaptiveError::Failed(TchError::Shape(_))),
        "{e:?}"
    );
}

#[test]
fn tch_errors_are_classified() {
    let oom = TchError::Torch(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes".into(),
    );
    assert_eq!(oom.oom_kind(), Some(OomKind::Cpu));
    let shape = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu))
        .f_reshape([7])
        .unwrap_err();
    assert_eq!(shape.oom_kind(), None, "{shape}");
}

/// Child: under an address-space limit 1 GiB above what it uses, allocate rows of 4 KiB
/// starting from 1 Mi rows (4 GiB): real CPU OOMs, retried to a size that fits.
#[test]
#[ignore = "a child process's entry point, run by the real CPU OOM test"]
fn child_real_cpu_oom() {
    if std::env::var_os("TT_ADAPTIVE_CHILD").is_none() {
        return;
    }
    let _warm = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    // As any program that selects a device does: with the CUDA wheel this maps
    // libtorch_cuda.so, driver or not. Only a loaded driver may refuse the limit.
    let _ = tt_sys::ensure_cuda_loaded();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    println!(
        "\n@@libtorch_cuda_mapped={}@@",
        maps.contains("libtorch_cuda.so")
    );
    if tt_adaptive::cuda_loaded() {
        let e = set_cpu_memory_limit(Some(1 << 40)).unwrap_err();
        assert!(matches!(e, tt_adaptive::LimitError::CudaLoaded), "{e:?}");
        println!("\n@@driver loaded: refused@@");
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let vm: u64 = status.lines().find(|l| l.starts_with("VmSize:")).unwrap()[7..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .unwrap()
        * 1024;
    set_cpu_memory_limit(Some(vm + (1 << 30))).unwrap();
    // The limit as the trainer's allocator setting reads it.
    assert_eq!(
        tt_adaptive::address_space_limit().unwrap(),
        Some(vm + (1 << 30))
    );
    let a = Adaptive::new().policy(Policy::Halve);
    let rows = a
        .batch(1 << 20, |n| {
            let t = Tensor::f_zeros([n as i64, 1024], (Kind::Float, Device::Cpu))?;
            Ok::<_, TchError>(t.size()[0])
        })
        .unwrap();
    let ooms: u64 = a.stats().iter().map(|s| s.ooms).sum();
    println!("\n@@rows={rows} ooms={ooms}@@");
    // Raised back: what the limit refused now fits (address space only, untouched).
    set_cpu_memory_limit(None).unwrap();
    let raised = Tensor::f_empty([(1i64 << 30) / 4 * 2], (Kind::Float, Device::Cpu)).is_ok();
    println!("\n@@raised={raised}@@");
}

#[test]
fn a_real_cpu_oom_is_retried_to_success() {
    let out = tt_testkit::rerun("child_real_cpu_oom")
        .env("TT_ADAPTIVE_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    if text.contains("@@driver loaded: refused@@") {
        return; // a GPU machine: the refusal was checked in the child
    }
    // The CUDA wheel's libtorch_cuda.so was mapped, and the limit worked anyway.
    let wheel_has_cuda =
        tt_sys::libtorch_lib_dir().is_ok_and(|d| d.join("libtorch_cuda.so").exists());
    assert!(
        !wheel_has_cuda || text.contains("@@libtorch_cuda_mapped=true@@"),
        "{text}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("@@rows="))
        .unwrap_or_else(|| panic!("{text}"));
    let fields: Vec<u64> = line
        .trim_matches('@')
        .split(' ')
        .map(|kv| kv.split('=').nth(1).unwrap().parse().unwrap())
        .collect();
    let (rows, ooms) = (fields[0], fields[1]);
    assert!(ooms >= 2, "{line}");
    assert!(rows * 4096 < 1 << 30 && rows >= 1 << 16, "{line}");
    assert!(
        text.contains("@@raised=true@@"),
        "2 GiB fit once the limit is removed: {text}"
    );
}

#[test]
fn an_address_space_limit_below_usage_is_refused() {
    let e = set_cpu_memory_limit(Some(1 << 20)).unwrap_err();
    assert!(e.to_string().contains("below"), "{e}");
}
