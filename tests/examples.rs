//! The `train` example as users run it: alone, then as two ranks under the launcher
//! `torchtools launch` uses, with checkpoints.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::path::Path;
use std::process::Command;

#[test]
fn the_train_example_runs_alone_and_under_the_launcher() {
    // cargo test builds examples: target/debug/deps/examples-<hash> -> target/debug/examples/train.
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples/train");
    assert!(example.exists(), "{} was not built", example.display());
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&example)
        .env("TORCHTOOLS_TRAIN_EPOCHS", "1")
        .env("TORCHTOOLS_DEVICE", "cpu")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("finished: 64 steps"),
        "alone: {} {said}",
        out.status
    );
    // Two ranks through the launcher `torchtools launch` uses, with checkpoints.
    std::env::set_var("TORCHTOOLS_TRAIN_EPOCHS", "1");
    std::env::set_var("TORCHTOOLS_DEVICE", "cpu");
    std::env::set_var("TORCHTOOLS_TRAIN_CKPT", dir.path());
    let outcome = torchtools::dist::launch(&torchtools::dist::LaunchConfig::local(
        2,
        example.as_os_str(),
        Vec::new(),
    ))
    .unwrap();
    assert_eq!(outcome.code, 0, "launched: {outcome:?}");
    // 2048 samples / (2 ranks x 32) = 32 steps; the last checkpoint is step 32.
    let latest = std::fs::read_to_string(dir.path().join("latest")).unwrap();
    assert!(latest.contains("00000032"), "latest checkpoint: {latest}");
    std::env::remove_var("TORCHTOOLS_TRAIN_CKPT");

    // One process on the two ranks' checkpoint: refused, naming both sizes.
    let alone = |ckpt: &Path, epochs: &str| {
        Command::new(&example)
            .env("TORCHTOOLS_TRAIN_EPOCHS", epochs)
            .env("TORCHTOOLS_TRAIN_CKPT", ckpt)
            .env("TORCHTOOLS_DEVICE", "cpu")
            .env_remove("TORCHTOOLS_LOG")
            .output()
            .unwrap()
    };
    let out = alone(dir.path(), "2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("run of 2 process(es)") && err.contains("has 1"),
        "{err}"
    );

    // Alone from the start, then one more epoch: the resume is visible in the logs
    // (torchtools::init_logging, info by default).
    let own = tempfile::tempdir().unwrap();
    assert!(alone(own.path(), "1").status.success());
    let out = alone(own.path(), "2");
    let err = String::from_utf8_lossy(&out.stderr);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resumed from"), "{err}");
    assert!(
        said.contains("finished: 128 steps (resumed from step 64)"),
        "{said}"
    );
}
