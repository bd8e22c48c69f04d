//! `cargo xtask test`: the CPU test matrix.

use anyhow::{bail, Result};

use crate::steps::{cargo, run_counted, run_tests_counted, summarize, StepResult};

/// The publishable crates, each tested on its own.
pub(crate) const CRATES: [&str; 15] = [
    "tt-sys",
    "tt-device",
    "tt-lock",
    "tt-fence",
    "tt-tracker",
    "tt-adaptive",
    "tt-probe",
    "tt-dist",
    "tt-sampler",
    "tt-ckpt",
    "tt-optim",
    "tt-reserve",
    "tt-train",
    "torchtools-cli",
    "torchtools",
];
/// Crates whose default and `--no-default-features` builds are the same (no libtorch
/// feature), so they are tested once, and not again in the workspace run (tt-sampler's
/// PyTorch comparisons take half a minute; tt-lock's tests spawn processes).
const FEATURELESS: [&str; 6] = [
    "tt-sampler",
    "tt-lock",
    "tt-fence",
    "tt-tracker",
    "tt-dist",
    "tt-reserve",
];

/// Every target but the doctests.
const NO_DOCTESTS: [&str; 4] = ["--lib", "--bins", "--tests", "--examples"];

/// Crates whose README (their documentation) shows libtorch in its examples, as users
/// get the crate (default features; tt-dist with `c10d`): their doctests run in the
/// step with that feature (and the workspace step), and the core's step, where they
/// could not compile, runs every other target.
const DOCTESTS_NEED_A_FEATURE: [&str; 7] = [
    "tt-sys",
    "tt-device",
    "tt-adaptive",
    "tt-probe",
    "tt-optim",
    "tt-train",
    "tt-dist",
];

/// Optional features tested on their own, beyond default and none: libtorch's
/// distributed engine (needs gloo's headers, which setup installs), the reservation's
/// tch device, the tracker's SQLite timelines and plots.
const EXTRA_FEATURES: [(&str, &str); 4] = [
    ("tt-sys", "c10d"),
    ("tt-dist", "c10d"),
    ("tt-reserve", "tch"),
    ("tt-tracker", "sqlite,plot"),
];

/// Crates with GPU tests (`tests/gpu.rs`, feature `gpu-tests`).
/// With each, the tests its binary must pass at least in the GPU bundle's `run.sh` on a
/// one-GPU machine (tests that need more GPUs, or MIG, report themselves not run and
/// do not count): a binary below its minimum, or missing, fails the run.
pub(crate) const GPU_CRATES: [(&str, u32); 12] = [
    ("tt-sys", 7),
    ("tt-dist", 4),
    ("tt-device", 5),
    ("tt-fence", 3),
    ("tt-tracker", 1),
    ("tt-adaptive", 5),
    ("tt-probe", 3),
    ("tt-ckpt", 3),
    ("tt-optim", 1),
    ("tt-train", 3),
    ("torchtools-cli", 8),
    ("torchtools", 2),
];

/// `cargo` arguments that select the GPU test target of `krate`, then `extra`.
pub(crate) fn gpu_test_args<'a>(krate: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "test",
        "-p",
        krate,
        "--features",
        "gpu-tests",
        "--test",
        "gpu",
    ];
    args.extend_from_slice(extra);
    args
}

/// The tests each step must pass at least (from the last full run): a step that
/// passes fewer lost tests (a target left out by its features, a renamed file, a test
/// that stopped being selected), even when it reads ok. Raise a figure when tests are
/// added; a step without a figure fails, so that every new step gets one.
/// The tests each test binary of each step must pass at least (from the last full
/// run; `binary:` lines after the matrix's summary): a whole test file can no longer
/// vanish while its step still passes on the others' count.
const MIN_PER_BINARY: &[(&str, &str, u64)] = &[
    ("test -p tt-sys (default features)", "tt_sys src/lib.rs", 2),
    ("test -p tt-sys (default features)", "tests/cpu.rs", 5),
    ("test -p tt-sys (default features)", "tt_sys doc-tests", 8),
    (
        "test -p tt-sys --no-default-features",
        "tt_sys src/lib.rs",
        1,
    ),
    (
        "test -p tt-device (default features)",
        "tt_device src/lib.rs",
        12,
    ),
    ("test -p tt-device (default features)", "tests/env.rs", 5),
    (
        "test -p tt-device (default features)",
        "tests/inventory.rs",
        5,
    ),
    ("test -p tt-device (default features)", "tests/select.rs", 5),
    ("test -p tt-device (default features)", "tests/tch.rs", 3),
    (
        "test -p tt-device (default features)",
        "tt_device doc-tests",
        4,
    ),
    (
        "test -p tt-device --no-default-features",
        "tt_device src/lib.rs",
        12,
    ),
    ("test -p tt-device --no-default-features", "tests/env.rs", 5),
    (
        "test -p tt-device --no-default-features",
        "tests/inventory.rs",
        5,
    ),
    (
        "test -p tt-device --no-default-features",
        "tests/select.rs",
        5,
    ),
    ("test -p tt-device --no-default-features", "tests/tch.rs", 0),
    ("test -p tt-lock (no features)", "tt_lock src/lib.rs", 42),
    ("test -p tt-lock (no features)", "tests/locks.rs", 25),
    ("test -p tt-lock (no features)", "tests/queue.rs", 9),
    ("test -p tt-lock (no features)", "tests/share.rs", 3),
    ("test -p tt-lock (no features)", "tests/trust.rs", 8),
    ("test -p tt-lock (no features)", "tt_lock doc-tests", 1),
    ("test -p tt-fence (no features)", "tt_fence src/lib.rs", 0),
    ("test -p tt-fence (no features)", "tests/cpu.rs", 1),
    ("test -p tt-fence (no features)", "tt_fence doc-tests", 1),
    (
        "test -p tt-tracker (no features)",
        "tt_tracker src/lib.rs",
        35,
    ),
    ("test -p tt-tracker (no features)", "tests/report.rs", 8),
    ("test -p tt-tracker (no features)", "tests/subtrack.rs", 12),
    ("test -p tt-tracker (no features)", "tests/track.rs", 21),
    (
        "test -p tt-tracker (no features)",
        "tt_tracker doc-tests",
        2,
    ),
    (
        "test -p tt-adaptive (default features)",
        "tt_adaptive src/lib.rs",
        2,
    ),
    (
        "test -p tt-adaptive (default features)",
        "tests/adaptive.rs",
        14,
    ),
    (
        "test -p tt-adaptive (default features)",
        "tests/defaults.rs",
        2,
    ),
    ("test -p tt-adaptive (default features)", "tests/tch.rs", 4),
    (
        "test -p tt-adaptive (default features)",
        "tt_adaptive doc-tests",
        6,
    ),
    (
        "test -p tt-adaptive --no-default-features",
        "tt_adaptive src/lib.rs",
        2,
    ),
    (
        "test -p tt-adaptive --no-default-features",
        "tests/adaptive.rs",
        14,
    ),
    (
        "test -p tt-adaptive --no-default-features",
        "tests/defaults.rs",
        1,
    ),
    (
        "test -p tt-adaptive --no-default-features",
        "tests/tch.rs",
        0,
    ),
    (
        "test -p tt-probe (default features)",
        "tt_probe src/lib.rs",
        7,
    ),
    ("test -p tt-probe (default features)", "tests/probe.rs", 10),
    ("test -p tt-probe (default features)", "tests/run.rs", 3),
    (
        "test -p tt-probe (default features)",
        "tt_probe doc-tests",
        5,
    ),
    (
        "test -p tt-probe --no-default-features",
        "tt_probe src/lib.rs",
        7,
    ),
    (
        "test -p tt-probe --no-default-features",
        "tests/probe.rs",
        4,
    ),
    ("test -p tt-probe --no-default-features", "tests/run.rs", 0),
    ("test -p tt-dist (no features)", "tt_dist src/lib.rs", 12),
    ("test -p tt-dist (no features)", "tests/launch.rs", 3),
    (
        "test -p tt-sampler (no features)",
        "tt_sampler src/lib.rs",
        6,
    ),
    ("test -p tt-sampler (no features)", "tests/resume.rs", 13),
    (
        "test -p tt-sampler (no features)",
        "tests/torch_parity.rs",
        2,
    ),
    (
        "test -p tt-sampler (no features)",
        "tt_sampler doc-tests",
        1,
    ),
    (
        "test -p tt-ckpt (default features)",
        "tt_ckpt src/lib.rs",
        12,
    ),
    ("test -p tt-ckpt (default features)", "tests/crash.rs", 1),
    ("test -p tt-ckpt (default features)", "tests/dir.rs", 16),
    (
        "test -p tt-ckpt (default features)",
        "tests/full_disk.rs",
        2,
    ),
    (
        "test -p tt-ckpt (default features)",
        "tests/load_memory.rs",
        1,
    ),
    ("test -p tt-ckpt (default features)", "tests/python.rs", 2),
    ("test -p tt-ckpt (default features)", "tests/tch.rs", 5),
    (
        "test -p tt-ckpt (default features)",
        "tests/torch_weights.rs",
        4,
    ),
    ("test -p tt-ckpt (default features)", "tt_ckpt doc-tests", 5),
    (
        "test -p tt-ckpt --no-default-features",
        "tt_ckpt src/lib.rs",
        12,
    ),
    ("test -p tt-ckpt --no-default-features", "tests/crash.rs", 1),
    ("test -p tt-ckpt --no-default-features", "tests/dir.rs", 16),
    (
        "test -p tt-ckpt --no-default-features",
        "tests/full_disk.rs",
        2,
    ),
    (
        "test -p tt-ckpt --no-default-features",
        "tests/load_memory.rs",
        0,
    ),
    (
        "test -p tt-ckpt --no-default-features",
        "tests/python.rs",
        2,
    ),
    ("test -p tt-ckpt --no-default-features", "tests/tch.rs", 0),
    (
        "test -p tt-ckpt --no-default-features",
        "tests/torch_weights.rs",
        0,
    ),
    (
        "test -p tt-ckpt --no-default-features",
        "tt_ckpt doc-tests",
        3,
    ),
    (
        "test -p tt-optim (default features)",
        "tt_optim src/lib.rs",
        2,
    ),
    ("test -p tt-optim (default features)", "tests/resume.rs", 3),
    (
        "test -p tt-optim (default features)",
        "tests/torch_parity.rs",
        3,
    ),
    (
        "test -p tt-optim (default features)",
        "tt_optim doc-tests",
        2,
    ),
    (
        "test -p tt-optim --no-default-features",
        "tt_optim src/lib.rs",
        2,
    ),
    (
        "test -p tt-optim --no-default-features",
        "tests/resume.rs",
        0,
    ),
    (
        "test -p tt-optim --no-default-features",
        "tests/torch_parity.rs",
        0,
    ),
    (
        "test -p tt-reserve (no features)",
        "tt_reserve src/lib.rs",
        2,
    ),
    ("test -p tt-reserve (no features)", "tests/backend.rs", 1),
    ("test -p tt-reserve (no features)", "tests/reserve.rs", 1),
    (
        "test -p tt-reserve (no features)",
        "tt_reserve doc-tests",
        2,
    ),
    (
        "test -p tt-train (default features)",
        "tt_train src/lib.rs",
        12,
    ),
    ("test -p tt-train (default features)", "tests/heap.rs", 3),
    ("test -p tt-train (default features)", "tests/state.rs", 2),
    (
        "test -p tt-train (default features)",
        "tests/trainer.rs",
        28,
    ),
    (
        "test -p tt-train (default features)",
        "tt_train doc-tests",
        14,
    ),
    (
        "test -p tt-train --no-default-features",
        "tt_train src/lib.rs",
        7,
    ),
    (
        "test -p torchtools-cli (default features)",
        "gpu_tracker src/bin/gpu-tracker.rs",
        0,
    ),
    (
        "test -p torchtools-cli (default features)",
        "torchtools src/main.rs",
        18,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/cli.rs",
        6,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/hooks.rs",
        4,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/jobs.rs",
        13,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/launch.rs",
        20,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/metrics.rs",
        2,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/serve.rs",
        2,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/probe.rs",
        7,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/readme.rs",
        7,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/reserve.rs",
        14,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/subtrack.rs",
        2,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/top.rs",
        4,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/track.rs",
        15,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/trust.rs",
        11,
    ),
    (
        "test -p torchtools-cli (default features)",
        "tests/usage.rs",
        2,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "gpu_tracker src/bin/gpu-tracker.rs",
        0,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "torchtools src/main.rs",
        18,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/cli.rs",
        6,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/hooks.rs",
        4,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/jobs.rs",
        13,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/launch.rs",
        20,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/metrics.rs",
        2,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/serve.rs",
        2,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/probe.rs",
        7,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/readme.rs",
        7,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/reserve.rs",
        14,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/subtrack.rs",
        2,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/top.rs",
        4,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/track.rs",
        15,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/trust.rs",
        11,
    ),
    (
        "test -p torchtools-cli --no-default-features",
        "tests/usage.rs",
        2,
    ),
    (
        "test -p torchtools (default features)",
        "torchtools src/lib.rs",
        0,
    ),
    ("test -p torchtools (default features)", "tests/demo.rs", 4),
    (
        "test -p torchtools (default features)",
        "tests/examples.rs",
        11,
    ),
    (
        "test -p torchtools (default features)",
        "torchtools doc-tests",
        2,
    ),
    (
        "test -p torchtools --no-default-features",
        "torchtools src/lib.rs",
        0,
    ),
    (
        "test -p torchtools --no-default-features",
        "tests/demo.rs",
        0,
    ),
    (
        "test -p torchtools --no-default-features",
        "torchtools doc-tests",
        2,
    ),
    ("test -p tt-sys --features c10d", "tt_sys src/lib.rs", 2),
    ("test -p tt-sys --features c10d", "tests/c10d.rs", 3),
    ("test -p tt-sys --features c10d", "tests/cpu.rs", 5),
    ("test -p tt-sys --features c10d", "tt_sys doc-tests", 8),
    ("test -p tt-dist --features c10d", "tt_dist src/lib.rs", 14),
    ("test -p tt-dist --features c10d", "tests/c10d.rs", 15),
    ("test -p tt-dist --features c10d", "tests/launch.rs", 3),
    ("test -p tt-dist --features c10d", "tt_dist doc-tests", 4),
    (
        "test -p tt-reserve --features tch",
        "tt_reserve src/lib.rs",
        2,
    ),
    ("test -p tt-reserve --features tch", "tests/backend.rs", 1),
    ("test -p tt-reserve --features tch", "tests/reserve.rs", 1),
    (
        "test -p tt-reserve --features tch",
        "tt_reserve doc-tests",
        2,
    ),
    (
        "test -p tt-tracker --features sqlite,plot",
        "tt_tracker src/lib.rs",
        36,
    ),
    (
        "test -p tt-tracker --features sqlite,plot",
        "tests/report.rs",
        8,
    ),
    (
        "test -p tt-tracker --features sqlite,plot",
        "tests/subtrack.rs",
        13,
    ),
    (
        "test -p tt-tracker --features sqlite,plot",
        "tests/track.rs",
        21,
    ),
    (
        "test -p tt-tracker --features sqlite,plot",
        "tt_tracker doc-tests",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "torchtools src/lib.rs",
        0,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/demo.rs",
        4,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/examples.rs",
        11,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_adaptive src/lib.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/adaptive.rs",
        14,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/defaults.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/tch.rs",
        12,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_ckpt src/lib.rs",
        12,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/crash.rs",
        1,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/dir.rs",
        16,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/full_disk.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/load_memory.rs",
        1,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/python.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/torch_weights.rs",
        4,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_device src/lib.rs",
        12,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/env.rs",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/inventory.rs",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/select.rs",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_optim src/lib.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/resume.rs",
        3,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/torch_parity.rs",
        3,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_probe src/lib.rs",
        7,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/probe.rs",
        10,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/run.rs",
        3,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_sys src/lib.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/c10d.rs",
        3,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/cpu.rs",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_testkit src/lib.rs",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_train src/lib.rs",
        12,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/heap.rs",
        3,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/state.rs",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tests/trainer.rs",
        28,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "xtask src/main.rs",
        23,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "torchtools doc-tests",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_adaptive doc-tests",
        6,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_ckpt doc-tests",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_device doc-tests",
        4,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_optim doc-tests",
        2,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_probe doc-tests",
        5,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_sys doc-tests",
        8,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_testkit doc-tests",
        0,
    ),
    (
        "test --workspace (all CPU features, doc tests)",
        "tt_train doc-tests",
        14,
    ),
];

const MIN_PASSED: [(&str, u64); 29] = [
    ("test -p tt-sys (default features)", 13),
    ("test -p tt-sys --no-default-features", 1),
    ("test -p tt-device (default features)", 30),
    ("test -p tt-device --no-default-features", 23),
    ("test -p tt-lock (no features)", 69),
    ("test -p tt-fence (no features)", 2),
    ("test -p tt-tracker (no features)", 76),
    ("test -p tt-adaptive (default features)", 27),
    ("test -p tt-adaptive --no-default-features", 17),
    ("test -p tt-probe (default features)", 24),
    ("test -p tt-probe --no-default-features", 11),
    ("test -p tt-dist (no features)", 14),
    ("test -p tt-sampler (no features)", 22),
    ("test -p tt-ckpt (default features)", 41),
    ("test -p tt-ckpt --no-default-features", 31),
    ("test -p tt-optim (default features)", 10),
    ("test -p tt-optim --no-default-features", 2),
    ("test -p tt-reserve (no features)", 6),
    ("test -p tt-train (default features)", 54),
    ("test -p tt-train --no-default-features", 6),
    ("test -p torchtools-cli (default features)", 98),
    ("test -p torchtools-cli --no-default-features", 98),
    ("test -p torchtools (default features)", 16),
    ("test -p torchtools --no-default-features", 2),
    ("test -p tt-sys --features c10d", 16),
    ("test -p tt-dist --features c10d", 35),
    ("test -p tt-reserve --features tch", 5),
    ("test -p tt-tracker --features sqlite,plot", 78),
    ("test --workspace (all CPU features, doc tests)", 211),
];

/// What is wrong with a test step's binaries against `minimums` (step, binary, tests it
/// must pass at least): a binary below its figure or gone (a test file lost, a target
/// left out by its features), or one without a figure (add it).
pub(crate) fn binary_problems(result: &StepResult, minimums: &[(&str, &str, u64)]) -> Vec<String> {
    let passed = |binary: &str| {
        result
            .binaries
            .iter()
            .find(|(b, _)| b == binary)
            // A test skipped knowingly (listed apart) still exists: a minimum guards
            // against tests that vanished.
            .map(|(_, c)| c.passed + c.not_run)
    };
    let mut problems = Vec::new();
    for (_, binary, minimum) in minimums.iter().filter(|(s, _, _)| *s == result.name) {
        match passed(binary) {
            None if *minimum > 0 => problems.push(format!(
                "the test binary {binary} did not run (expected at least {minimum} tests)"
            )),
            Some(n) if n < *minimum => problems.push(format!(
                "the test binary {binary} passed {n} tests, expected at least {minimum}"
            )),
            _ => {}
        }
    }
    for (binary, _) in &result.binaries {
        if !minimums
            .iter()
            .any(|(s, b, _)| *s == result.name && b == binary)
        {
            problems.push(format!(
                "the test binary {binary} has no expected minimum: add it to MIN_PER_BINARY \
                 in xtask/src/test.rs"
            ));
        }
    }
    problems
}

pub(crate) fn cpu_matrix() -> Result<()> {
    crate::setup::setup()?;
    let mut results: Vec<StepResult> = Vec::new();
    test_steps(&mut results);
    // The README's "Using it from your project", in a new crate outside the repository.
    results.push(crate::downstream::check());
    // The command as Python users get it: a wheel, installed into a fresh venv.
    results.push(crate::wheel::check());
    lint_steps(&mut results);
    package_steps(&mut results);
    let total = summarize("cpu-matrix", &results);
    let failed: Vec<&str> = results
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.name.as_str())
        .collect();
    if !failed.is_empty() || total.failed > 0 {
        bail!("the CPU matrix failed: {}", failed.join(", "));
    }
    if total.passed == 0 {
        bail!("the CPU matrix ran no test");
    }
    Ok(())
}

/// A step that runs tests (its name starts with "test "): held to its minimum, and each
/// of its test binaries to theirs.
fn test_step(name: String, args: &[&str]) -> StepResult {
    let minimum = MIN_PASSED
        .iter()
        .find(|(step, _)| *step == name)
        .map_or(u64::MAX, |(_, n)| *n);
    let mut result = run_tests_counted(&name, cargo(args), minimum);
    for problem in binary_problems(&result, MIN_PER_BINARY) {
        eprintln!("{name}: {problem}");
        result.ok = false;
    }
    result
}

/// The format check and the tests: each crate with and without its default features,
/// the extra features, then the workspace with every CPU feature and its doc tests.
fn test_steps(results: &mut Vec<StepResult>) {
    let mut step = |name: String, args: &[&str]| {
        results.push(if name.starts_with("test ") {
            test_step(name, args)
        } else {
            run_counted(&name, cargo(args))
        })
    };
    step("fmt --check".into(), &["fmt", "--all", "--check"]);
    for krate in CRATES {
        if FEATURELESS.contains(&krate) {
            let mut args = vec!["test", "-p", krate];
            if DOCTESTS_NEED_A_FEATURE.contains(&krate) {
                args.extend(NO_DOCTESTS);
            }
            step(format!("test -p {krate} (no features)"), &args);
            continue;
        }
        step(
            format!("test -p {krate} (default features)"),
            &["test", "-p", krate],
        );
        let mut args = vec!["test", "-p", krate, "--no-default-features"];
        if DOCTESTS_NEED_A_FEATURE.contains(&krate) {
            args.extend(NO_DOCTESTS);
        }
        step(format!("test -p {krate} --no-default-features"), &args);
    }
    for (krate, feature) in EXTRA_FEATURES {
        step(
            format!("test -p {krate} --features {feature}"),
            &["test", "-p", krate, "--features", feature],
        );
    }
    // The CLI is tested on its own above: in a workspace-wide build, feature
    // unification would hand it tt-device's `tch` and test a binary users never get.
    let mut workspace = vec!["test", "--workspace", "--exclude", "torchtools-cli"];
    for krate in FEATURELESS {
        workspace.extend(["--exclude", krate]);
    }
    step(
        "test --workspace (all CPU features, doc tests)".into(),
        &workspace,
    );
}

/// Clippy (the workspace with the GPU test targets, then each crate without its
/// features), the GPU tests linked, the docs with warnings denied.
fn lint_steps(results: &mut Vec<StepResult>) {
    let mut step = |name: String, args: &[&str]| {
        results.push(run_counted(&name, cargo(args)));
    };
    // One workspace-wide lint, GPU test targets included: every configuration of
    // features costs a rebuild of torch-sys's C++ (about 2.5 minutes on 2 cores).
    let gpu_features = GPU_CRATES.map(|(k, _)| format!("{k}/gpu-tests")).join(",");
    step(
        "clippy --workspace --all-targets (+ GPU tests) -D warnings".into(),
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            &gpu_features,
            "--",
            "-D",
            "warnings",
        ],
    );
    for krate in CRATES {
        step(
            format!("clippy -p {krate} --no-default-features"),
            &[
                "clippy",
                "-p",
                krate,
                "--all-targets",
                "--no-default-features",
                "--",
                "-D",
                "warnings",
            ],
        );
    }
    for (krate, _) in GPU_CRATES {
        step(
            format!("build GPU tests of {krate} (link only)"),
            &gpu_test_args(krate, &["--no-run"]),
        );
    }
    let doc = {
        let mut cmd = cargo(&[
            "doc",
            "--workspace",
            "--no-deps",
            "--features",
            "tt-dist/c10d",
        ]);
        cmd.env("RUSTDOCFLAGS", "-D warnings");
        run_counted("doc --workspace (warnings denied)", cmd)
    };
    results.push(doc);
}

/// crates.io readiness, the fuzz target's lockfile, and the cores built without libtorch.
fn package_steps(results: &mut Vec<StepResult>) {
    // crates.io readiness: every publishable crate packaged as crates.io would get it
    // (the workspace's crates resolved from each other's packages, in dependency
    // order) and built from its package. Their cores need no libtorch, so the
    // verification builds without default features: libtorch is never built again.
    forget_unpacked_packages();
    results.push(run_counted(
        "package --workspace --no-default-features (each crate built from its package)",
        cargo(&[
            "package",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "tt-testkit",
            // The Python extension ships in the wheel, never on crates.io.
            "--exclude",
            "torchtools-py",
            "--no-default-features",
            "--allow-dirty",
        ]),
    ));
    // tt-ckpt's fuzz target is a workspace of its own with a tracked lockfile: it
    // must follow the crates' dependencies (running the fuzzer must not rewrite it).
    results.push(run_counted(
        "fuzz lockfile current (crates/tt-ckpt/fuzz)",
        cargo(&[
            "tree",
            "--locked",
            "--depth",
            "0",
            "--manifest-path",
            "crates/tt-ckpt/fuzz/Cargo.toml",
        ]),
    ));
    results.push(no_libtorch_in_cores());
}

/// Removes the copies of this workspace's crates that an earlier `cargo package` left
/// unpacked in Cargo's home.
///
/// The verification resolves the crates from a local registry of their fresh packages
/// (`target/package/tmp-registry`) and unpacks each into
/// `$CARGO_HOME/registry/src/-<hash>/<crate>-<version>`; Cargo skips the unpacking when
/// that directory exists, so a second run from the same checkout built tt-reserve
/// against the tt-lock of the first (CI failed so, 2026-11-26: "no method named
/// `sharers`"). Only directories of local registries (named `-<hash>`: a path has no
/// host) and only this workspace's crates are removed; Cargo unpacks them again.
fn forget_unpacked_packages() {
    let Some(home) = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo")))
    else {
        return;
    };
    let Ok(registries) = std::fs::read_dir(home.join("registry").join("src")) else {
        return;
    };
    for registry in registries.flatten() {
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue;
        }
        let Ok(unpacked) = std::fs::read_dir(registry.path()) else {
            continue;
        };
        for dir in unpacked.flatten() {
            let name = dir.file_name().to_string_lossy().into_owned();
            if CRATES.iter().any(|krate| is_unpacked(&name, krate)) {
                match std::fs::remove_dir_all(dir.path()) {
                    Ok(()) => eprintln!(
                        "removed {}, unpacked by an earlier run",
                        dir.path().display()
                    ),
                    Err(e) => eprintln!("could not remove {}: {e}", dir.path().display()),
                }
            }
        }
    }
}

/// Whether `dir` is `krate`'s unpacked package: `<krate>-<version>`.
fn is_unpacked(dir: &str, krate: &str) -> bool {
    dir.strip_prefix(krate)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|version| version.starts_with(|c: char| c.is_ascii_digit()))
}

/// The map's one rule: every crate's core (no default features) builds without
/// libtorch. Checked on the dependency graph, not by luck of the build.
fn no_libtorch_in_cores() -> StepResult {
    let start = std::time::Instant::now();
    let mut ok = true;
    eprintln!("\n==> invariant: no libtorch in any crate's core");
    for krate in CRATES {
        let out = cargo(&[
            "tree",
            "-p",
            krate,
            "--no-default-features",
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        .output();
        match out {
            Ok(out) if out.status.success() => {
                let tree = String::from_utf8_lossy(&out.stdout);
                if let Some(line) = tree
                    .lines()
                    .find(|l| l.starts_with("torch-sys") || l.starts_with("tch "))
                {
                    eprintln!("{krate} --no-default-features depends on {line}");
                    ok = false;
                }
            }
            _ => ok = false,
        }
    }
    // And the CLI, built as users build it, does not even link libtorch.
    let built = cargo(&["build", "-p", "torchtools-cli"])
        .status()
        .is_ok_and(|s| s.success());
    let exe = crate::root().join("target/debug/torchtools");
    match std::process::Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
    {
        Ok(out) if built && out.status.success() => {
            let dynamic = String::from_utf8_lossy(&out.stdout);
            let libtorch = dynamic
                .lines()
                .find(|l| l.contains("NEEDED") && (l.contains("libtorch") || l.contains("libc10")));
            if let Some(line) = libtorch {
                eprintln!("the torchtools CLI links libtorch: {line}");
                ok = false;
            }
        }
        _ => {
            eprintln!(
                "could not build or inspect {} (readelf, from binutils, is needed)",
                exe.display()
            );
            ok = false;
        }
    }
    StepResult {
        name: "invariant: cores and CLI without libtorch".into(),
        ok,
        time: start.elapsed(),
        counts: None,
        binaries: Vec::new(),
        skipped: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::is_unpacked;

    #[test]
    fn only_the_crates_own_unpacked_packages_are_recognised() {
        assert!(is_unpacked("tt-lock-0.1.0", "tt-lock"));
        assert!(is_unpacked("torchtools-cli-0.1.0", "torchtools-cli"));
        assert!(!is_unpacked("torchtools-cli-0.1.0", "torchtools"));
        assert!(!is_unpacked("tt-lockfree-1.0.0", "tt-lock"));
        assert!(!is_unpacked("tt-lock", "tt-lock"));
    }
}

#[cfg(test)]
mod binary_tests {
    use super::binary_problems;
    use crate::steps::{Counts, StepResult};

    fn result(binaries: &[(&str, u64)]) -> StepResult {
        StepResult {
            name: "test -p k".into(),
            ok: true,
            time: std::time::Duration::ZERO,
            counts: None,
            binaries: binaries
                .iter()
                .map(|(b, n)| {
                    let c = Counts {
                        passed: *n,
                        ..Counts::default()
                    };
                    ((*b).to_owned(), c)
                })
                .collect(),
            skipped: Vec::new(),
        }
    }

    #[test]
    fn a_binary_gone_below_its_minimum_or_without_one_is_a_problem() {
        let minimums = [
            ("test -p k", "k src/lib.rs", 3),
            ("test -p k", "tests/a.rs", 2),
            ("test -p other", "tests/b.rs", 9),
        ];
        let all = result(&[("k src/lib.rs", 3), ("tests/a.rs", 5)]);
        assert_eq!(binary_problems(&all, &minimums), Vec::<String>::new());
        // tests/a.rs vanished: the step's own count could still be high.
        let gone = result(&[("k src/lib.rs", 30)]);
        let p = binary_problems(&gone, &minimums);
        assert_eq!(p.len(), 1);
        assert!(p[0].contains("tests/a.rs did not run"), "{p:?}");
        let below = result(&[("k src/lib.rs", 2), ("tests/a.rs", 2)]);
        assert!(
            binary_problems(&below, &minimums)[0].contains("passed 2 tests, expected at least 3")
        );
        let new = result(&[("k src/lib.rs", 3), ("tests/a.rs", 2), ("tests/c.rs", 1)]);
        assert!(binary_problems(&new, &minimums)[0].contains("tests/c.rs has no expected minimum"));
    }
}
