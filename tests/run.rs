//! The probe → reserve → train flow end to end on this machine (CPU: the probe measures
//! CPU memory and the reservation of `gpu: Auto` is empty).
#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)]

use torchtools::device::Bytes;
use torchtools::probe::{BoxError, ProbeContext, ProbeError, ProbeOptions, Step};
use torchtools::{run_training_with_reservation, ReserveOptions, RunError, RunOptions};

fn alloc_32m(ctx: &ProbeContext) -> Result<Step, BoxError> {
    let device = ctx.device;
    let mut kept = Vec::new();
    Ok(Box::new(move || {
        kept.push(tch::Tensor::f_ones([8 << 20], (tch::Kind::Float, device))?);
        kept.truncate(1);
        Ok(())
    }))
}

fn fails(_: &ProbeContext) -> Result<Step, BoxError> {
    Err("the dataset is missing".into())
}

#[test]
fn probe_entry() {
    torchtools::probe::entry(&[("alloc_32m", alloc_32m), ("fails", fails)]);
}

fn options(name: &str) -> RunOptions {
    RunOptions {
        probe: Some((
            name.into(),
            ProbeOptions {
                device: Some("cpu".into()),
                ..ProbeOptions::in_test("probe_entry")
            },
        )),
        reserve: ReserveOptions {
            fence: false,
            ..ReserveOptions::default()
        },
        ..RunOptions::default()
    }
}

#[test]
fn probe_reserve_train_runs_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    std::env::set_var("TORCHTOOLS_LOCK_DIR", tmp.path());
    let out = run_training_with_reservation(
        |reservation, plan| {
            let report = plan.probe.as_ref().unwrap();
            // 32 MiB (a second 32 MiB tensor exists briefly at each step).
            assert!(report.peak() >= Bytes::mib(32), "{report}");
            assert!(plan.reserved > report.peak());
            reservation.gpus().len()
        },
        options("alloc_32m"),
    )
    .unwrap();
    let gpus = torchtools::device::Inventory::query().gpus.len();
    assert_eq!(
        out,
        gpus.min(1),
        "one GPU reserved where there is one, none on CPU"
    );

    let e = run_training_with_reservation(
        |_, _| unreachable!("no training after a failed probe"),
        options("fails"),
    )
    .unwrap_err();
    assert!(
        matches!(e, RunError::Probe(ProbeError::Failed { .. })),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with("probe stage:") && text.contains("the dataset is missing"),
        "{text}"
    );
}
