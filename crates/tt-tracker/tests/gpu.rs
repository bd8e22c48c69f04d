//! GPU test (`cargo xtask test-gpu`): a descendant's CUDA memory, through NVML. The
//! child is Python's torch (the GPU machine has PyTorch; `PYTHON` chooses it).
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use tt_tracker::{RamUnit, Tracker, TrackerConfig};

#[test]
fn a_child_allocating_2_gib_on_cuda_is_counted_under_descendants() {
    let nvml = nvml_wrapper::Nvml::init().expect("GPU tests need NVML");
    assert!(nvml.device_count().unwrap() > 0, "GPU tests need a GPU");
    // The tracked process itself holds GPU memory through a fence: 1 GiB asked, less
    // the CUDA context the fence creates first.
    let free = nvml.device_by_index(0).unwrap().memory_info().unwrap().free;
    let keep = free - (1 << 30) - tt_fence::DEFAULT_SAFETY_MARGIN.0;
    let fence = tt_fence::Fence::raise(
        0,
        &tt_fence::FenceOptions::keep_free(tt_device::Bytes(keep)),
    )
    .unwrap();
    let held = fence.fenced().0;
    assert!(held >= 1 << 28, "the fence holds only {held} bytes");
    let tracker = Tracker::start(TrackerConfig {
        interval: Duration::from_millis(50),
        gpu_ram_unit: RamUnit::Bytes,
        ..TrackerConfig::default()
    })
    .unwrap();
    let python = tt_testkit::python_path();
    let mut child = Command::new(python)
        .args([
            "-c",
            "import torch, time, sys\n\
             x = torch.ones(2 << 30, dtype=torch.uint8, device='cuda')\n\
             a = torch.randn(4096, 4096, device='cuda')\n\
             t = time.time()\n\
             while time.time() - t < 1.5:\n\
             \x20   a = (a @ a).clamp_(-1, 1)\n\
             torch.cuda.synchronize(); print('ready', flush=True); time.sleep(0.5)",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    assert!(child.wait().unwrap().success());
    let usage = tracker.stop().unwrap();
    println!("{usage}");
    let g = &usage.max_gpu_ram;
    assert!(g.descendants >= (2u64 << 30) as f64, "{g:?}");
    // Each process's memory where it belongs: the fence's in main, the child's 2 GiB in
    // the descendants.
    assert!(g.main >= held as f64, "{g:?}, the fence holds {held}");
    assert!(g.main < g.descendants, "{g:?}");
    drop(fence);
    assert!(
        g.combined >= g.descendants && g.system >= g.combined,
        "{g:?}"
    );
    assert!(usage.gpu_utilization.system_gpu_count > 0);
    assert_eq!(
        usage.torchtools.energy.len(),
        usage.gpu_utilization.n_expected_gpus
    );
    // 1.5 s of matrix products: the GPUs used energy, and one was busy.
    for e in &usage.torchtools.energy {
        assert!(e.joules > 0.0, "{e:?}");
    }
    let busy = &usage.gpu_utilization.gpu_percentages;
    assert!(busy.max_sum_percent > 0.0, "{busy:?}");
}
