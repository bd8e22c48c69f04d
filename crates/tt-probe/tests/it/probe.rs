//! Probes in real child processes on this (CPU) machine: Rust probes re-executing this
//! test binary, and commands; their failures; the estimate.

use std::time::{Duration, Instant};

use tt_device::Bytes;
use tt_probe::{probe_command, CommandProbe, MemoryKind, ProbeError};

#[cfg(feature = "tch")]
mod rust_probes {
    use super::*;
    use tch::nn;
    use tt_optim::{AdamConfig, Algorithm, SgdConfig};
    use tt_probe::{probe, BoxError, ProbeContext, ProbeOptions, ProbeSpec, Step};

    const MIB_64: i64 = 64 << 20;

    fn alloc_64m(ctx: &ProbeContext) -> Result<Step, BoxError> {
        let device = ctx.device;
        let mut kept = Vec::new();
        Ok(Box::new(move || {
            if kept.is_empty() {
                // 64 MiB of ones: touched, so resident.
                kept.push(tch::Tensor::f_ones([MIB_64], (tch::Kind::Uint8, device))?);
            }
            Ok(())
        }))
    }

    fn panics(_: &ProbeContext) -> Result<Step, BoxError> {
        panic!("the probe's model could not be built")
    }

    fn exits_7(_: &ProbeContext) -> Result<Step, BoxError> {
        std::process::exit(7)
    }

    fn sleeps(_: &ProbeContext) -> Result<Step, BoxError> {
        Ok(Box::new(|| {
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        }))
    }

    fn panics_out_of_memory(ctx: &ProbeContext) -> Result<Step, BoxError> {
        let device = ctx.device;
        Ok(Box::new(move || {
            // tch's plain call panics on libtorch's real out-of-memory (1 TiB).
            let _t = tch::Tensor::ones([1 << 40], (tch::Kind::Uint8, device));
            Ok(())
        }))
    }

    fn ooms(_: &ProbeContext) -> Result<Step, BoxError> {
        Ok(Box::new(|| {
            Err("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes".into())
        }))
    }

    fn mlp(ctx: &ProbeContext) -> Result<Step, BoxError> {
        ProbeSpec::new(
            |p| {
                Box::new(
                    nn::seq_t()
                        .add(nn::linear(p / "l1", 784, 1024, Default::default()))
                        .add_fn(|x| x.relu())
                        .add(nn::linear(p / "l2", 1024, 10, Default::default())),
                )
            },
            [256, 784],
        )
        .build(ctx)
    }

    /// One 4096 x 4096 layer (64 MiB of weights), stepped by `algorithm`.
    fn wide(ctx: &ProbeContext, algorithm: Algorithm) -> Result<Step, BoxError> {
        ProbeSpec::new(
            |p| Box::new(nn::seq_t().add(nn::linear(p / "l", 4096, 4096, Default::default()))),
            [8, 4096],
        )
        .loss(tt_probe::Loss::Mse)
        .optimizer(algorithm)
        .build(ctx)
    }

    fn wide_sgd(ctx: &ProbeContext) -> Result<Step, BoxError> {
        wide(ctx, Algorithm::Sgd(SgdConfig::default()))
    }

    fn wide_adam(ctx: &ProbeContext) -> Result<Step, BoxError> {
        wide(ctx, Algorithm::Adam(AdamConfig::adam()))
    }

    /// The probe child's side: runs when re-executed with TORCHTOOLS_PROBE_RUN.
    #[test]
    #[ignore = "a child process's entry point, run by the probe tests"]
    fn probe_child() {
        tt_probe::entry(&[
            ("alloc_64m", alloc_64m),
            ("panics", panics),
            ("exits_7", exits_7),
            ("sleeps", sleeps),
            ("ooms", ooms),
            ("panics_out_of_memory", panics_out_of_memory),
            ("mlp", mlp),
            ("wide_sgd", wide_sgd),
            ("wide_adam", wide_adam),
        ]);
    }

    fn opts() -> ProbeOptions {
        ProbeOptions {
            device: Some("cpu".into()),
            ..ProbeOptions::in_test("probe::rust_probes::probe_child")
        }
    }

    #[test]
    fn a_known_allocation_is_reported_within_5_percent() {
        let r = probe("alloc_64m", &opts()).unwrap();
        assert_eq!(r.memory, MemoryKind::Cpu);
        let rss = r.rss_peak.unwrap().0 as f64;
        let truth = MIB_64 as f64;
        assert!((rss - truth).abs() <= truth * 0.05, "{r}");
        assert_eq!(r.steps, 5);
        assert!(r.estimate(&Default::default()) > Bytes(MIB_64 as u64));
    }

    #[test]
    fn a_training_step_with_an_optimizer_is_measured() {
        let r = probe("mlp", &ProbeOptions { steps: 3, ..opts() }).unwrap();
        // Weights (3.2 MB) + Adam's two moments + gradients + activations.
        assert!(r.rss_peak.unwrap() > Bytes::mib(8), "{r}");
        assert_eq!(r.steps, 3);
    }

    #[test]
    fn the_training_optimizers_state_is_in_the_peak() {
        // Plain SGD keeps no state; Adam (tt-optim's, as training runs it) keeps two
        // moments per weight: 2 x 64 MiB more.
        let sgd = probe("wide_sgd", &ProbeOptions { steps: 2, ..opts() }).unwrap();
        let adam = probe("wide_adam", &ProbeOptions { steps: 2, ..opts() }).unwrap();
        let (sgd, adam) = (sgd.rss_peak.unwrap().0, adam.rss_peak.unwrap().0);
        assert!(
            adam >= sgd + (110 << 20),
            "Adam {} vs SGD {}: the moments are missing",
            Bytes(adam),
            Bytes(sgd)
        );
    }

    #[test]
    fn failures_are_errors_with_the_status_and_stderr() {
        let e = probe("panics", &opts()).unwrap_err();
        assert!(matches!(e, ProbeError::Failed { code: 3, .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("panicked: the probe's model could not be built"),
            "{e}"
        );
        // A panic of tch on a real out-of-memory is an out-of-memory, not a crash.
        let e = probe("panics_out_of_memory", &opts()).unwrap_err();
        assert!(matches!(e, ProbeError::OutOfMemory { .. }), "{e:?}");
        assert!(e.to_string().contains("can't allocate memory"), "{e}");
        let e = probe("exits_7", &opts()).unwrap_err();
        assert!(matches!(e, ProbeError::Failed { code: 7, .. }), "{e:?}");
        let e = probe("ooms", &opts()).unwrap_err();
        assert!(matches!(e, ProbeError::OutOfMemory { .. }), "{e:?}");
        let e = probe("missing", &opts()).unwrap_err();
        assert!(e.to_string().contains("no probe of that name"), "{e}");
        let start = Instant::now();
        let e = probe(
            "sleeps",
            &ProbeOptions {
                timeout: Duration::from_secs(2),
                ..opts()
            },
        )
        .unwrap_err();
        let took = start.elapsed();
        assert!(matches!(e, ProbeError::Timeout { .. }), "{e:?}");
        assert!(
            // Never before the timeout; well before the 30 s the child would sleep.
            took >= Duration::from_secs(2) && took < Duration::from_secs(20),
            "{took:?}"
        );
    }

    #[test]
    fn a_binary_without_entry_gives_a_clear_error() {
        // Re-running a test that does not call entry(): the child exits 0, no report.
        let e = probe(
            "alloc_64m",
            &ProbeOptions {
                device: Some("cpu".into()),
                ..ProbeOptions::in_test("probe::rust_probes::not_an_entry")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("tt_probe::entry"), "{e}");
    }

    #[test]
    fn not_an_entry() {}
}

#[test]
fn a_command_is_probed_with_the_probe_variables() {
    let tmp = tempfile::tempdir().unwrap();
    let seen = tmp.path().join("env");
    let script = format!(
        "echo $TORCHTOOLS_PROBE $TORCHTOOLS_PROBE_STEPS > {}; head -c 100000000 /dev/zero | tail -c 1 > /dev/null",
        seen.display()
    );
    let r = probe_command(
        &"sh".into(),
        &["-c".into(), script.into()],
        &CommandProbe {
            steps: 7,
            ..CommandProbe::default()
        },
    )
    .unwrap();
    assert_eq!(std::fs::read_to_string(&seen).unwrap().trim(), "1 7");
    assert_eq!(r.memory, MemoryKind::Cpu);
    assert!(!r.ended_by_timeout);
    assert!(r.rss_peak.unwrap() > Bytes::kib(100), "{r}");
}

#[test]
fn command_failures_and_timeouts() {
    let e = probe_command(
        &"sh".into(),
        &["-c".into(), "echo boom >&2; exit 3".into()],
        &CommandProbe::default(),
    )
    .unwrap_err();
    assert!(matches!(e, ProbeError::Failed { code: 3, .. }), "{e:?}");
    assert!(e.to_string().contains("boom"), "{e}");
    let e = probe_command(
        &"sh".into(),
        &["-c".into(), "kill -9 $$".into()],
        &CommandProbe::default(),
    )
    .unwrap_err();
    assert!(matches!(e, ProbeError::Crashed { signal: 9, .. }), "{e:?}");
    let e = probe_command(&"no-such-command-tt".into(), &[], &CommandProbe::default()).unwrap_err();
    assert!(matches!(e, ProbeError::Spawn { .. }), "{e:?}");
    // A command that does not stop on its own: ended by the timeout, its children too.
    let start = Instant::now();
    let r = probe_command(
        &"sh".into(),
        &["-c".into(), "sleep 30 & sleep 30".into()],
        &CommandProbe {
            timeout: Duration::from_millis(500),
            ..CommandProbe::default()
        },
    )
    .unwrap();
    assert!(r.ended_by_timeout);
    // Not waiting for the 30 s sleeps (the group was killed); a bound far from both
    // numbers, so that a busy machine cannot fail it.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

/// A command whose memory is `160 MiB + batch × 4 MiB` (bytes it writes, so resident),
/// held for a moment as a training step holds its activations. (The base is above
/// this test binary's own RSS, which the kernel's `ru_maxrss` of a child spawned from
/// it includes: the image it had before `exec`.)
fn batch_command() -> (std::ffi::OsString, Vec<std::ffi::OsString>) {
    (
        tt_testkit::python_path().into(),
        vec![
            "-c".into(),
            "import os, time\nb = int(os.environ['TORCHTOOLS_PROBE_BATCH'])\n\
             base = b'\\x01' * (160 << 20)\nx = b'\\x01' * (b << 22)\ntime.sleep(0.5)\n"
                .into(),
        ],
    )
}

fn peak_at(batch: u64) -> tt_probe::ProbeReport {
    let (program, args) = batch_command();
    probe_command(
        &program,
        &args,
        &CommandProbe {
            batch: Some(batch),
            ..CommandProbe::default()
        },
    )
    .unwrap()
}

#[test]
fn the_largest_batch_is_predicted_from_three_measured_probes() {
    let capacity = Bytes::mib(512);
    let search = tt_probe::BatchSearch::new(capacity);
    let mut asked = Vec::new();
    let found = tt_probe::max_batch(&search, |b| {
        asked.push(b);
        Ok(peak_at(b))
    })
    .unwrap();
    let peaks: Vec<_> = found.probes.iter().map(|(b, r)| (*b, r.peak())).collect();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert_eq!(&asked[..2], &[2, 4]);
    // ~4 MiB per sample measured from RSS.
    let per_sample = found.line.per_sample / Bytes::mib(1).0 as f64;
    assert!((3.8..4.2).contains(&per_sample), "{found}; {peaks:?}");
    // Real runs: the predicted batch's reservation fits, three samples more do not.
    let policy = tt_probe::EstimatePolicy::default();
    let at = peak_at(found.batch).estimate(&policy);
    assert!(
        at <= capacity,
        "{found}: the real run at it needs {at}; {peaks:?}"
    );
    let over = peak_at(found.batch + 3).estimate(&policy);
    assert!(over > capacity, "{found}: three more need only {over}");
}

#[test]
fn a_command_that_ignores_the_batch_variable_is_named() {
    // The same 256 MiB whatever the batch (above this test binary's own RSS, which the
    // kernel's figure for a child includes).
    let script = "import time\nx = b'\\x01' * (256 << 20)\ntime.sleep(0.2)\n";
    let e = tt_probe::max_batch(&tt_probe::BatchSearch::new(Bytes::gib(4)), |b| {
        probe_command(
            &tt_testkit::python_path().into(),
            &["-c".into(), script.into()],
            &CommandProbe {
                batch: Some(b),
                ..CommandProbe::default()
            },
        )
    })
    .unwrap_err();
    assert!(e.to_string().contains("TORCHTOOLS_PROBE_BATCH"), "{e}");
}
