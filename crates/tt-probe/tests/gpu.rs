//! GPU tests (`cargo xtask test-gpu`): the estimate against a real training run of the
//! same model (a plain tch loop in its own process, not the probe's harness), measured
//! by NVML (which includes the CUDA context); a model too large for the GPU reported as
//! out of memory.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::process::Stdio;
use std::time::Duration;

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule};
use tt_probe::{
    probe, BoxError, EstimatePolicy, MemoryKind, ProbeContext, ProbeError, ProbeOptions, ProbeSpec,
    Step,
};

fn mlp(ctx: &ProbeContext, width: i64) -> Result<Step, BoxError> {
    ProbeSpec::new(
        move |p| {
            Box::new(
                nn::seq_t()
                    .add(nn::linear(p / "l1", 1024, width, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(p / "l2", width, width, Default::default()))
                    .add_fn(|x| x.relu())
                    .add(nn::linear(p / "l3", width, 10, Default::default())),
            )
        },
        [512, 1024],
    )
    .build(ctx)
}

fn small(ctx: &ProbeContext) -> Result<Step, BoxError> {
    mlp(ctx, 1024)
}
fn medium(ctx: &ProbeContext) -> Result<Step, BoxError> {
    mlp(ctx, 8192)
}
fn large(ctx: &ProbeContext) -> Result<Step, BoxError> {
    mlp(ctx, 24576)
}
/// 150 000² weights in one layer: 90 GB, more than any one GPU here holds.
fn huge(ctx: &ProbeContext) -> Result<Step, BoxError> {
    mlp(ctx, 150_000)
}

const WIDTHS: [(&str, i64); 3] = [("small", 1024), ("medium", 8192), ("large", 24576)];

/// The truth: what a user's own training loop of the same model holds on the GPU. A
/// plain program as `examples/train` is (Adam from tt-optim, the optimizer torchtools
/// trains with; new random batches each step; 20 steps), waiting on stdin once trained
/// so that NVML can be asked about it: the caching allocator keeps its peak reserved, so
/// what NVML sees then is the run's peak.
#[test]
#[ignore = "a child process's entry point, run by the GPU probe tests"]
fn real_run_child() {
    let Ok(width) = std::env::var("TT_PROBE_REAL_WIDTH") else {
        return;
    };
    let width: i64 = width.parse().unwrap();
    tt_sys::require_cuda();
    let dev = Device::Cuda(0);
    let vs = nn::VarStore::new(dev);
    let p = vs.root();
    let model = nn::seq_t()
        .add(nn::linear(&p / "l1", 1024, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l2", width, width, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l3", width, 10, Default::default()));
    let mut opt =
        Optimizer::new(&vs, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant).unwrap();
    for _ in 0..20 {
        let x = Tensor::randn([512, 1024], (Kind::Float, dev));
        let y = Tensor::randint(10, [512], (Kind::Int64, dev));
        let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y);
        opt.backward_step(&loss).unwrap();
    }
    tch::Cuda::synchronize(0);
    println!("@@trained");
    let mut rest = String::new();
    let _ = std::io::stdin().read_to_string(&mut rest);
}

/// NVML's memory of a real run of the model of `width`, once it has trained.
fn real_run_peak(width: i64) -> u64 {
    let mut child = tt_testkit::rerun("real_run_child")
        .env("TT_PROBE_REAL_WIDTH", width.to_string())
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    tt_testkit::wait_for_line(
        child.stdout.take().unwrap(),
        "@@trained",
        Duration::from_secs(300),
    );
    let pid = child.id();
    let inventory = tt_device::Inventory::query();
    let used = inventory
        .gpus
        .iter()
        .flat_map(|g| &g.processes)
        .find(|p| p.pid == pid)
        .and_then(|p| p.used);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    used.unwrap_or_else(|| panic!("NVML does not list the real run (pid {pid}): {inventory:?}"))
        .0
}

#[test]
#[ignore = "a child process's entry point, run by the GPU probe tests"]
fn probe_child() {
    tt_probe::entry(&[
        ("small", small),
        ("medium", medium),
        ("large", large),
        ("huge", huge),
    ]);
}

#[test]
fn the_estimate_is_within_10_percent_above_a_real_runs_peak() {
    tt_sys::require_cuda();
    for (name, width) in WIDTHS {
        let opts = ProbeOptions {
            device: Some("cuda:0".into()),
            ..ProbeOptions::in_test("probe_child")
        };
        let report = probe(name, &ProbeOptions { steps: 3, ..opts }).unwrap();
        assert_eq!(report.memory, MemoryKind::Gpu);
        assert!(
            report.peak_reserved.is_some() && report.nvml_peak.is_some(),
            "{report}"
        );
        let truth = real_run_peak(width) as f64;
        let estimate = report.estimate(&EstimatePolicy::default()).0 as f64;
        println!(
            "{name}: {report}; estimate {estimate:.0} vs real NVML peak {truth:.0} ({:.3}x)",
            estimate / truth
        );
        assert!(
            (1.0..=1.10).contains(&(estimate / truth)),
            "{name}: estimate {estimate} vs {truth}"
        );
    }
}

#[test]
fn a_model_larger_than_the_gpu_is_reported_as_out_of_memory() {
    tt_sys::require_cuda();
    let opts = ProbeOptions {
        device: Some("cuda:0".into()),
        steps: 1,
        ..ProbeOptions::in_test("probe_child")
    };
    match probe("huge", &opts) {
        Err(ProbeError::OutOfMemory { message, .. }) => {
            assert!(message.contains("out of memory"), "{message}");
            println!("huge: {message}");
        }
        other => panic!("a 90 GB layer: {other:?}"),
    }
}
