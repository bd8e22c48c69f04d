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
}

#[test]
fn nvml_sees_this_process_once_it_holds_gpu_memory() {
    tt_sys::require_cuda();
    let _t = tch::Tensor::zeros([64 << 20], (tch::Kind::Float, tch::Device::Cuda(0)));
    let me = std::process::id();
    let inv = Inventory::query();
    let listed = inv
        .gpus
        .iter()
        .flat_map(|g| &g.processes)
        .any(|p| p.pid == me);
    // In a container NVML may report host pids; then at least one process is listed.
    assert!(
        listed || inv.gpus.iter().any(|g| !g.processes.is_empty()),
        "{inv:?}"
    );
}
