//! The probe → reserve → train flow end to end on this machine (CPU: the probe measures
//! CPU memory and the reservation of `gpu: Auto` is empty).

use tt_device::Bytes;
use tt_probe::{
    run_training_with_reservation, BoxError, ProbeContext, ProbeError, ProbeOptions, RunError,
    RunOptions, Step,
};
use tt_reserve::ReserveOptions;

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
    tt_probe::entry(&[("alloc_32m", alloc_32m), ("fails", fails)]);
}

/// One lock directory for this test binary, set before any test reads it.
fn private_lock_dir() {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY (edition 2021: safe fn): set once, under the OnceLock, before any lock.
        std::env::set_var("TORCHTOOLS_LOCK_DIR", dir.path());
        dir
    });
}

fn options(name: &str) -> RunOptions {
    RunOptions {
        probe: Some((
            name.into(),
            ProbeOptions {
                device: Some("cpu".into()),
                ..ProbeOptions::in_test("run::probe_entry")
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
    private_lock_dir();
    let out = run_training_with_reservation(
        |reservation, plan| {
            let report = plan.probe.as_ref().unwrap();
            // 32 MiB (a second 32 MiB tensor exists briefly at each step).
            assert!(report.peak() >= Bytes::mib(32), "{report}");
            let gpus = reservation.gpus().len();
            match plan.reserved {
                Some(bytes) => assert!(bytes > report.peak() && gpus > 0, "{plan}"),
                None => assert!(gpus == 0 && plan.to_string().starts_with("nothing reserved")),
            }
            Ok::<_, BoxError>(gpus)
        },
        options("alloc_32m"),
    )
    .unwrap();
    let gpus = tt_device::Inventory::query().gpus.len();
    assert_eq!(
        out,
        gpus.min(1),
        "one GPU reserved where there is one, none on CPU"
    );

    let e = run_training_with_reservation(
        |_, _| -> Result<(), BoxError> { unreachable!("no training after a failed probe") },
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

#[test]
fn trainings_value_and_error_come_back_with_their_cause() {
    private_lock_dir();
    let no_fence = || RunOptions {
        reserve: ReserveOptions {
            fence: false,
            ..ReserveOptions::default()
        },
        ..RunOptions::default()
    };
    let value =
        run_training_with_reservation(|_, _| Ok::<_, std::io::Error>("trained"), no_fence());
    assert_eq!(value.unwrap(), "trained");

    let e = run_training_with_reservation(
        |_, _| -> Result<(), _> {
            Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "shard 7 is missing",
            ))
        },
        no_fence(),
    )
    .unwrap_err();
    let RunError::Train(cause) = &e else {
        panic!("{e:?}")
    };
    let io = cause.downcast_ref::<std::io::Error>().unwrap();
    // Said once: the cause is in the message, not also the source.
    assert!(std::error::Error::source(&e).is_none());
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    assert_eq!(e.to_string(), "training: shard 7 is missing");
}
