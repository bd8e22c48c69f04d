//! GPU tests (`cargo xtask test-gpu`): the fence against the real driver, measured
//! through NVML, which sees every process's memory.
#![allow(clippy::unwrap_used)]

use tt_device::{Bytes, CudaDriver, Inventory};
use tt_fence::{Fence, FenceOptions, DEFAULT_SAFETY_MARGIN};

/// Slack for the driver's own bookkeeping between NVML's and cuMemGetInfo's views.
const SLACK: u64 = 256 << 20;

fn require_gpu() {
    let driver = CudaDriver::init().expect("GPU tests need the CUDA driver");
    assert!(driver.device_count().unwrap() > 0, "GPU tests need a GPU");
}

fn nvml_free(uuid: &str) -> u64 {
    let inv = Inventory::query();
    inv.gpus
        .iter()
        .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
        .expect("NVML sees the fenced GPU")
        .free
        .0
}

fn close(a: u64, b: u64, slack: u64) -> bool {
    a.abs_diff(b) <= slack
}

#[test]
fn fence_leaves_the_requested_bytes_free_and_lowering_gives_them_back() {
    require_gpu();
    let keep = Bytes::gib(4);
    let mut fence = Fence::raise(0, &FenceOptions::keep_free(keep)).unwrap();
    let report = fence.report().clone();
    println!("{report}");
    let uuid = report.uuid.clone();
    assert!(report.fenced.0 > 0 && report.fenced.0 <= report.target.0);
    let free = nvml_free(&uuid);
    let expected = keep.0 + DEFAULT_SAFETY_MARGIN.0;
    assert!(
        close(free, expected, SLACK),
        "free with the fence up: {} (expected {} ± {})",
        Bytes(free),
        Bytes(expected),
        Bytes(SLACK)
    );

    let freed = fence.shrink(Bytes::gib(1)).unwrap();
    assert!(freed.0 >= 1 << 30, "shrink freed {freed}");
    let after_shrink = nvml_free(&uuid);
    assert!(
        close(after_shrink, free + freed.0, SLACK),
        "{after_shrink} vs {free} + {freed}"
    );

    let rest = fence.lower().unwrap();
    assert_eq!(fence.fenced(), Bytes(0));
    assert_eq!(freed.0 + rest.0, report.fenced.0);
    let after = nvml_free(&uuid);
    assert!(
        close(after, report.free_before.0, SLACK),
        "lowered: {} free, {} before the fence",
        Bytes(after),
        report.free_before
    );
    assert_eq!(
        fence.lower().unwrap(),
        Bytes(0),
        "lowering twice frees nothing"
    );
}

#[test]
fn a_fence_by_uuid_is_the_same_gpu() {
    require_gpu();
    let uuid = CudaDriver::init().unwrap().uuid(0).unwrap();
    let mut fence = Fence::raise_on_uuid(&uuid, &FenceOptions::keep_free(Bytes::gib(8))).unwrap();
    assert_eq!(fence.report().ordinal, 0);
    assert_eq!(fence.report().uuid, uuid);
    // The fence holds that GPU's memory: 8 GiB and the margin left free there.
    let free = nvml_free(&uuid);
    let expected = Bytes::gib(8).0 + DEFAULT_SAFETY_MARGIN.0;
    assert!(
        close(free, expected, SLACK),
        "free with the fence by UUID up: {} (expected {} ± {})",
        Bytes(free),
        Bytes(expected),
        Bytes(SLACK)
    );
    fence.lower().unwrap();
    assert!(
        nvml_free(&uuid) > free + (4 << 30),
        "lowered, the memory is back"
    );
    // A UUID of no GPU here is an error that names it, not a fence on some other GPU.
    let stranger = "GPU-00000000-1111-2222-3333-444444444444";
    let Err(err) = Fence::raise_on_uuid(stranger, &FenceOptions::keep_free(Bytes::gib(8))) else {
        panic!("a fence on {stranger}, which no GPU here has");
    };
    assert!(err.to_string().contains(stranger), "{err}");
}

/// Asks plain PyTorch, in its own process, for `gib` GiB on the GPU: "allocated" or
/// "oom" (PyTorch's own out-of-memory error).
fn pytorch_allocates(gib: u64) -> String {
    let script = "import sys, torch\n\
                  n = int(sys.argv[1])\n\
                  try:\n\
                  \x20   x = torch.empty(n << 30, dtype=torch.uint8, device='cuda')\n\
                  \x20   torch.cuda.synchronize(); print('allocated')\n\
                  except torch.OutOfMemoryError:\n\
                  \x20   print('oom')\n";
    let out = std::process::Command::new(tt_testkit::python_path())
        .args(["-c", script, &gib.to_string()])
        .env_remove("CUDA_VISIBLE_DEVICES")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn a_process_that_does_not_cooperate_runs_out_of_memory_at_the_fence() {
    require_gpu();
    let mut fence = Fence::raise(0, &FenceOptions::keep_free(Bytes::gib(4))).unwrap();
    // 4 GiB left free: PyTorch's context and 2 GiB fit, 6 GiB does not.
    assert_eq!(pytorch_allocates(6), "oom");
    assert_eq!(pytorch_allocates(2), "allocated");
    fence.lower().unwrap();
    assert_eq!(pytorch_allocates(6), "allocated");
}
