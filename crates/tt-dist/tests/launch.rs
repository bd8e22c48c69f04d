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

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    // Rank 1 fails once rank 0 is ready; rank 0 ignores SIGTERM, so only the SIGKILL
    // that follows the grace period ends it, and never before that period.
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then while [ ! -e {r} ]; do sleep 0.01; done; exit 3; fi; \
         trap '' TERM; touch {r}; while :; do sleep 0.05; done",
        r = ready.display()
    );
    let mut cfg = LaunchConfig::local(2, "sh", vec!["-c".into(), script.into()]);
    cfg.grace = std::time::Duration::from_millis(500);
    let start = std::time::Instant::now();
    let out = launch(&cfg).unwrap();
    assert_eq!(out.code, 3, "the failed rank's status: {out:?}");
    assert_eq!(
        out.failed.as_ref().map(|(r, how)| (*r, how.as_str())),
        Some((1, "exited with status 3")),
        "{out:?}"
    );
    assert!(
        start.elapsed() >= cfg.grace,
        "rank 0 was given its grace period: {:?}",
        start.elapsed()
    );
}
