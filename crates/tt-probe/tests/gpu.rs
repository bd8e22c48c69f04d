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
        Err(ProbeError::OutOfMemory {
            reason: message, ..
        }) => {
            assert!(message.contains("out of memory"), "{message}");
            println!("huge: {message}");
        }
        other => panic!("a 90 GB layer: {other:?}"),
    }
}

/// NVML's free memory on the GPU `uuid`.
fn nvml_free(uuid: &str) -> u64 {
    tt_device::Inventory::query()
        .gpus
        .iter()
        .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
        .expect("NVML lists the reserved GPU")
        .free
        .0
}

/// The Python torchtools' `run_training_with_reservation` on the GPU: the probe's
/// estimate becomes the reservation, whose lock is held (by this process) and whose
/// fence leaves that much free while training runs; both are gone afterwards.
#[test]
fn run_training_with_reservation_reserves_the_probes_estimate_on_the_gpu() {
    tt_sys::require_cuda();
    let locks = tempfile::tempdir().unwrap();
    std::env::set_var("TORCHTOOLS_LOCK_DIR", locks.path());
    let options = tt_probe::RunOptions {
        probe: Some((
            "medium".into(),
            ProbeOptions {
                device: Some("cuda:0".into()),
                steps: 3,
                ..ProbeOptions::in_test("probe_child")
            },
        )),
        ..tt_probe::RunOptions::default()
    };
    let uuid = tt_device::CudaDriver::init().unwrap().uuid(0).unwrap();
    let free_before = nvml_free(&uuid);
    let me = std::process::id();
    let seen = tt_probe::run_training_with_reservation(
        |reservation, plan| -> Result<(u64, u64), BoxError> {
            let report = plan.probe.as_ref().expect("the probe ran");
            let estimate = report.estimate(&EstimatePolicy::default());
            assert_eq!(plan.reserved, Some(estimate), "{plan}");
            assert!(estimate.0 > 1 << 28, "{plan}");
            let gpu = &reservation.gpus()[0];
            assert_eq!(gpu.ordinal, Some(0));
            assert!(reservation.fenced().0 > 0);
            let dir = tt_lock::LockDir::from_env().unwrap();
            let states = dir.status(&tt_device::Inventory::query()).unwrap();
            let held = states
                .iter()
                .find(|s| s.held)
                .unwrap_or_else(|| panic!("no lock held: {states:?}"));
            assert_eq!(held.holder.as_ref().map(|h| h.who.pid), Some(me), "{held}");
            // The fence leaves the estimate (and the margin) free: training fits in it.
            let free = nvml_free(&uuid);
            println!("{plan}; {free} bytes free with the fence up");
            train_medium_briefly()?;
            Ok((estimate.0, free))
        },
        options,
    )
    .unwrap();
    let (estimate, free_during) = seen;
    let margin = tt_fence::DEFAULT_SAFETY_MARGIN.0;
    assert!(
        free_during.abs_diff(estimate + margin) < 512 << 20,
        "{free_during} free, the estimate {estimate} and margin {margin} expected"
    );
    // Released: the lock is free, the fence is down (this process's CUDA context and
    // cached blocks from training stay).
    let dir = tt_lock::LockDir::from_env().unwrap();
    let states = dir.status(&tt_device::Inventory::query()).unwrap();
    assert!(states.iter().all(|s| !s.held), "{states:?}");
    tt_sys::empty_cache().unwrap();
    let free_after = nvml_free(&uuid);
    assert!(
        free_after + (2 << 30) > free_before,
        "after: {free_after}, before: {free_before}"
    );
}

/// A few steps of the medium model on cuda:0 in this process.
fn train_medium_briefly() -> Result<(), BoxError> {
    let dev = Device::Cuda(0);
    let vs = nn::VarStore::new(dev);
    let p = vs.root();
    let model = nn::seq_t()
        .add(nn::linear(&p / "l1", 1024, 8192, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l2", 8192, 8192, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "l3", 8192, 10, Default::default()));
    let mut opt = Optimizer::new(&vs, Algorithm::Adam(AdamConfig::adam()), Schedule::Constant)?;
    for _ in 0..3 {
        let x = Tensor::f_randn([512, 1024], (Kind::Float, dev))?;
        let y = Tensor::f_randint(10, [512], (Kind::Int64, dev))?;
        let loss = model.forward_t(&x, true).cross_entropy_for_logits(&y);
        opt.backward_step(&loss)?;
    }
    Ok(())
}
