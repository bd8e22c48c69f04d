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

pub(crate) fn cpu_matrix() -> Result<()> {
    crate::setup::setup()?;
    let mut results: Vec<StepResult> = Vec::new();
    // Steps whose name starts with "test" must run at least one test.
    let mut step = |name: String, args: &[&str]| {
        results.push(if name.starts_with("test ") {
            let minimum = MIN_PASSED
                .iter()
                .find(|(step, _)| *step == name)
                .map_or(u64::MAX, |(_, n)| *n);
            run_tests_counted(&name, cargo(args), minimum)
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
    // The README's "Using it from your project", in a new crate outside the repository.
    // (The closure above holds `results` until its last use; the steps after this one
    // count no tests.)
    results.push(crate::downstream::check());
    // The command as Python users get it: a wheel, installed into a fresh venv.
    results.push(crate::wheel::check());
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
