//! GPU tests (`cargo xtask test-gpu`): the estimate against a real training run of the
//! same model, measured by NVML (which includes the CUDA context).
#![allow(clippy::unwrap_used)]

use tch::nn;
use tt_probe::{
    probe, BoxError, EstimatePolicy, MemoryKind, ProbeContext, ProbeOptions, ProbeSpec, Step,
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

#[test]
#[ignore = "a child process's entry point, run by the GPU probe tests"]
fn probe_child() {
    tt_probe::entry(&[("small", small), ("medium", medium), ("large", large)]);
}

#[test]
fn the_estimate_is_within_10_percent_above_a_real_runs_peak() {
    tt_sys::require_cuda();
    for name in ["small", "medium", "large"] {
        let opts = ProbeOptions {
            device: Some("cuda:0".into()),
            ..ProbeOptions::in_test("probe_child")
        };
        let report = probe(
            name,
            &ProbeOptions {
                steps: 3,
                ..opts.clone()
            },
        )
        .unwrap();
        assert_eq!(report.memory, MemoryKind::Gpu);
        assert!(
            report.peak_reserved.is_some() && report.nvml_peak.is_some(),
            "{report}"
        );
        // The real run: the same model for 20 steps, in its own process.
        let real = probe(name, &ProbeOptions { steps: 20, ..opts }).unwrap();
        let truth = real.nvml_peak.unwrap().0 as f64;
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
