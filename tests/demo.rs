//! The facade end to end: its re-exports, and the demo binary started the way a user
//! starts a binary (another directory, no LD_LIBRARY_PATH).
#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_facade_reexports_device_selection_and_the_shim() {
    let device = torchtools::device::select().unwrap();
    let t = torchtools::tch::Tensor::ones([4], (torchtools::tch::Kind::Float, device));
    assert_eq!(t.sum(torchtools::tch::Kind::Float).double_value(&[]), 4.0);
    assert_eq!(torchtools::sys::libtorch_version(), "2.11.0");
}

fn demo_binary() -> PathBuf {
    // target/debug/deps/demo-<hash> -> target/debug/examples/demo (cargo test builds examples).
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/demo")
}

#[test]
fn the_demo_trains_from_any_directory_without_ld_library_path() {
    let demo = demo_binary();
    assert!(demo.exists(), "{} was not built", demo.display());
    let out = Command::new(&demo)
        .current_dir(std::env::temp_dir())
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("TORCHTOOLS_DEVICE")
        .env("TORCHTOOLS_DEMO_STEPS", "50")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("torchtools device report (libtorch's view)"),
        "{stdout}"
    );
    assert!(stdout.contains("trained 50 steps on "), "{stdout}");
}

#[test]
fn the_demo_refuses_bad_input_with_a_clear_error() {
    let out = Command::new(demo_binary())
        .env("TORCHTOOLS_DEMO_STEPS", "many")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("TORCHTOOLS_DEMO_STEPS=\"many\" is not a positive integer"),
        "{stderr}"
    );
    let out = Command::new(demo_binary())
        .env("TORCHTOOLS_DEVICE", "cuda:9")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("TORCHTOOLS_DEVICE=\"cuda:9\""));
}
