//! The trainer's allocator setting (`keep_freed_memory`) in a process of its own (it is
//! the process's): a step's freed memory is no longer handed back and faulted in again
//! once a `Trainer` exists.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tch::Device;
use tt_dist::ProcessGroup;
use tt_train::{keep_freed_memory, FreedMemory, TrainConfig, Trainer};

fn minor_faults() -> i64 {
    // SAFETY: a plain C struct, all zeros is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    assert_eq!(rc, 0);
    usage.ru_minflt
}

/// Nine "steps" (after one to settle), each allocating 24 blocks of 1 MiB, writing
/// them and freeing them all: the page faults they took.
fn faults_of_steps() -> i64 {
    let step = || {
        let blocks: Vec<Vec<u8>> = (0..24).map(|_| vec![1u8; 1 << 20]).collect();
        std::hint::black_box(&blocks);
    };
    step();
    let before = minor_faults();
    (0..9).for_each(|_| step());
    minor_faults() - before
}

#[test]
fn a_step_s_freed_memory_is_kept_for_the_next_one() {
    if std::env::vars().any(|(k, _)| k.starts_with("MALLOC_") || k == "GLIBC_TUNABLES") {
        // The environment has chosen: keep_freed_memory leaves it, as tested below.
        assert!(matches!(keep_freed_memory(), FreedMemory::Left(_)));
        return;
    }
    let by_default = faults_of_steps();
    // glibc's defaults hand the 24 MiB back at each step's end: about 6,000 faults
    // a step.
    assert!(
        by_default > 9 * 3000,
        "glibc's default kept the memory already ({by_default} faults in 9 steps)"
    );
    let trainer = |keep: bool, adaptive: bool| {
        let config = TrainConfig::new(8, 2, 1)
            .handle_signals(false)
            .keep_freed_memory(keep)
            .adaptive_micro_batch(adaptive);
        Trainer::with_group(config, ProcessGroup::single(), Device::Cpu).unwrap()
    };
    // A trainer told not to keep it, or one that expects out-of-memory errors (kept
    // heap memory cannot serve a large block), changes nothing.
    drop(trainer(false, false));
    drop(trainer(true, true));
    let still = faults_of_steps();
    assert!(still > 9 * 3000, "{still} faults in 9 steps");
    // A trainer as made by default keeps it from then on.
    drop(trainer(true, false));
    assert_eq!(keep_freed_memory(), FreedMemory::Kept);
    let kept = faults_of_steps();
    assert!(
        kept < 9 * 100,
        "{kept} page faults in 9 steps with the memory kept ({by_default} without)"
    );
}

/// Child of the test below: under an address-space limit, glibc's thresholds are left
/// alone (memory kept on the heap would count against the limit for good).
#[test]
fn child_under_an_address_space_limit() {
    if std::env::var_os("TT_HEAP_CHILD").is_none() {
        return;
    }
    let vm = tt_adaptive::address_space_in_use().unwrap();
    tt_adaptive::set_cpu_memory_limit(Some(vm + (8 << 30))).unwrap();
    match keep_freed_memory() {
        FreedMemory::Left(why) => println!("\n@@left: {why}@@"),
        other => println!("\n@@changed: {other:?}@@"),
    }
}

#[test]
fn under_an_address_space_limit_glibc_s_thresholds_are_left_alone() {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "--exact",
            "child_under_an_address_space_limit",
            "--nocapture",
        ])
        .env("TT_HEAP_CHILD", "1")
        // The environment's own choice would be named instead of the limit.
        .env_remove("GLIBC_TUNABLES");
    for name in tt_train::MALLOC_VARIABLES {
        child.env_remove(name);
    }
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("@@left: the process has an address-space limit (RLIMIT_AS)@@"),
        "{stdout}"
    );
}
