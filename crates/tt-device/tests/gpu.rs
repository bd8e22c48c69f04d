//! GPU-only tests, selected by `cargo xtask test-gpu` (feature `gpu-tests`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tt_device::{Device, Inventory, NvmlStatus};

#[test]
fn auto_selects_cuda_and_tensors_land_there() {
    tt_sys::require_cuda();
    let sel = tt_device::select_device().unwrap();
    assert!(matches!(sel.device, Device::Cuda(_)), "{sel:?}");
    let t = tch::Tensor::ones([1024], (tch::Kind::Float, sel.device.into()));
    assert_eq!(t.sum(tch::Kind::Float).double_value(&[]), 1024.0);
    assert_eq!(t.device(), tch::Device::from(sel.device));
}

#[test]
fn the_report_lists_the_gpu_with_its_uuid() {
    tt_sys::require_cuda();
    let report = tt_device::report();
    assert!(
        matches!(report.nvml, NvmlStatus::Available { .. }),
        "{:?}",
        report.nvml
    );
    assert!(!report.gpus.is_empty());
    let gpu = &report.gpus[0].gpu;
    assert!(gpu.uuid.starts_with("GPU-"), "{}", gpu.uuid);
    assert!(gpu.total.0 > gpu.free.0 && gpu.free.0 > 0);
    assert!(report.to_string().contains(&gpu.uuid));
    assert!(report.libtorch.unwrap().cuda_runtime.is_some());
    // The CUDA driver's name of cuda:0 leads back to this GPU (its own UUID, or one of
    // its MIG instances' when MIG mode is on).
    let cuda0 = tt_device::CudaDriver::init().unwrap().uuid(0).unwrap();
    let inventory = Inventory::query();
    let found = inventory
        .gpu_of(&cuda0)
        .expect("cuda:0 is a GPU NVML lists");
    assert_eq!(found.uuid, gpu.uuid);
    println!(
        "cuda:0 {cuda0}: GPU {}, MIG instances {:?}",
        found.uuid, found.mig
    );
}

#[test]
fn nvml_sees_this_process_once_it_holds_gpu_memory() {
    tt_sys::require_cuda();
    let pids = |inv: &Inventory| -> Vec<(u32, u64)> {
        inv.gpus
            .iter()
            .flat_map(|g| &g.processes)
            .map(|p| (p.pid, p.used.map_or(0, |b| b.0)))
            .collect()
    };
    let before = pids(&Inventory::query());
    // 256 MiB on the GPU (plus this process's CUDA context).
    let _t = tch::Tensor::zeros([64 << 20], (tch::Kind::Float, tch::Device::Cuda(0)));
    let after = pids(&Inventory::query());
    let me = std::process::id();
    // This process, by its pid, or (in a container, NVML speaks the host's pids) a
    // process that was not there before, holding at least the 256 MiB: another
    // process already on the GPU no longer passes for this one.
    let new: Vec<&(u32, u64)> = after
        .iter()
        .filter(|(pid, _)| !before.iter().any(|(b, _)| b == pid))
        .collect();
    let seen =
        after.iter().any(|(pid, _)| *pid == me) || new.iter().any(|(_, used)| *used >= 256 << 20);
    assert!(seen, "before {before:?}, after {after:?}, this pid {me}");
}
