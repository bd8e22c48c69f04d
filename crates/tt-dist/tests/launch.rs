//! The launcher's exit statuses, with real processes.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tt_dist::{launch, LaunchConfig, EXIT_PREEMPTED};

fn sh(nproc: usize, script: &str, max_restarts: u32) -> tt_dist::LaunchOutcome {
    let mut cfg = LaunchConfig::local(nproc, "sh", vec!["-c".into(), script.into()]);
    cfg.max_restarts = max_restarts;
    launch(&cfg).unwrap()
}

#[test]
fn a_preempted_group_is_passed_on_and_never_restarted() {
    // Every rank checkpointed and exits 75, one later than the other: the launch is
    // 75, with no restart even where restarts are allowed.
    let out = sh(2, "if [ \"$RANK\" = 1 ]; then sleep 0.2; fi; exit 75", 3);
    assert_eq!(out.code, EXIT_PREEMPTED, "{out:?}");
    assert_eq!(out.restarts, 0, "{out:?}");
}

#[test]
fn a_failure_is_restarted_then_passed_on() {
    let out = sh(2, "exit 3", 1);
    assert_eq!((out.code, out.restarts), (3, 1), "{out:?}");
    let out = sh(2, "exit 0", 1);
    assert_eq!((out.code, out.restarts), (0, 0), "{out:?}");
}
