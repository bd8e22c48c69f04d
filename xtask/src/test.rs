//! `cargo xtask test`: the CPU test matrix.

use anyhow::{bail, Result};

use crate::minimums::Minimums;
use crate::steps::{cargo, run_counted, summarize, StepResult};

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
/// feature), so they are tested once (tt-sampler's PyTorch comparisons take half a
/// minute; tt-lock's and the CLI's tests spawn processes).
const FEATURELESS: [&str; 7] = [
    "torchtools-cli",
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

/// `record`: write what each test step and binary passed as their minimums
/// (`xtask/minimums.tsv`), once the whole run has passed, instead of holding the run
/// to the figures there.
pub(crate) fn cpu_matrix(record: bool) -> Result<()> {
    crate::setup::setup()?;
    let minimums = match record {
        true => None,
        false => Some(Minimums::read()?),
    };
    let mut results: Vec<StepResult> = Vec::new();
    test_steps(&mut results, minimums.as_ref());
    // The command as Python users get it: a wheel, installed into a fresh venv.
    results.push(crate::wheel::check());
    lint_steps(&mut results);
    package_steps(&mut results);
    // The README's "Using it from your project", in a new crate outside the repository.
    // Last: it names libtorch by the path a user's project uses, not the workspace's
    // link, and torch-sys rebuilds (its C++ and all above it) whenever that changes;
    // in the middle of the matrix it cost that rebuild twice, the second for the steps
    // after it.
    results.push(crate::downstream::check());
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
    if record {
        let order: Vec<String> = results.iter().map(|r| r.name.clone()).collect();
        let path = crate::minimums::path();
        std::fs::write(&path, Minimums::of(&results).render(&order))?;
        println!("recorded the minimums in {}", path.display());
    }
    Ok(())
}

/// A step that runs tests: held to its recorded minimum, and each of its test binaries
/// to theirs (`minimums`; `None` while recording: it must still pass a test).
fn test_step(name: String, args: &[&str], minimums: Option<&Minimums>) -> StepResult {
    let mut result = run_counted(&name, cargo(args));
    let problems = match minimums {
        Some(m) => m.problems(&result),
        None if result.counts.map_or(0, |c| c.passed) == 0 => vec!["passed no test".to_owned()],
        None => Vec::new(),
    };
    for problem in problems {
        eprintln!("{name}: {problem}");
        result.ok = false;
    }
    result
}

/// The test steps, in order, with their cargo arguments: each crate with and without
/// its default features (once where they are the same), the extra features, then the
/// project's own tools. (Each crate's doc tests run in its step with the features
/// they need.)
fn test_plan() -> Vec<(String, Vec<&'static str>)> {
    let mut plan = Vec::new();
    for krate in CRATES {
        if FEATURELESS.contains(&krate) {
            let mut args = vec!["test", "-p", krate];
            if DOCTESTS_NEED_A_FEATURE.contains(&krate) {
                args.extend(NO_DOCTESTS);
            }
            plan.push((format!("test -p {krate} (no features)"), args));
            continue;
        }
        plan.push((
            format!("test -p {krate} (default features)"),
            vec!["test", "-p", krate],
        ));
        let mut args = vec!["test", "-p", krate, "--no-default-features"];
        if DOCTESTS_NEED_A_FEATURE.contains(&krate) {
            args.extend(NO_DOCTESTS);
        }
        plan.push((format!("test -p {krate} --no-default-features"), args));
    }
    for (krate, feature) in EXTRA_FEATURES {
        plan.push((
            format!("test -p {krate} --features {feature}"),
            vec!["test", "-p", krate, "--features", feature],
        ));
    }
    plan.push((
        "test -p xtask -p tt-testkit (the project's own tools)".into(),
        vec!["test", "-p", "xtask", "-p", "tt-testkit"],
    ));
    plan
}

/// The names of the test steps (each has a recorded minimum).
#[cfg(test)]
pub(crate) fn test_step_names() -> Vec<String> {
    test_plan().into_iter().map(|(name, _)| name).collect()
}

/// The format check, then the test steps of [`test_plan`].
fn test_steps(results: &mut Vec<StepResult>, minimums: Option<&Minimums>) {
    results.push(run_counted(
        "fmt --check",
        cargo(&["fmt", "--all", "--check"]),
    ));
    for (name, args) in test_plan() {
        results.push(test_step(name, &args, minimums));
    }
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

/// The external crates the matrix's steps build with different features on the target
/// side (what the tests link; `cargo tree` without build scripts and proc-macros):
/// crate and version, and each feature list seen. Each list is a build of that crate
/// and of every crate above it, torch-sys's C++ and tch included; the
/// `tt-workspace-hack` crate gives every step the union.
#[cfg(test)]
fn external_feature_variants(
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>> {
    use anyhow::Context;
    let mut seen: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for (_, args) in test_plan() {
        let mut tree = vec![
            "tree",
            "-q",
            "-e",
            "normal,dev,no-proc-macro",
            "--prefix",
            "none",
        ];
        tree.extend(["--format", "{p} [{f}]"]);
        // What `cargo test` selects beyond packages and features is not the graph's.
        tree.extend(args.iter().skip(1).filter(|a| !NO_DOCTESTS.contains(a)));
        let out = cargo(&tree).output().context("running cargo tree")?;
        if !out.status.success() {
            bail!(
                "cargo {}: {}",
                tree.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some((package, features)) = line.split_once(" [") else {
                continue;
            };
            // The workspace's own crates (named with their path) vary by design.
            if package.contains(" (") {
                continue;
            }
            let features = features.trim_end_matches(" (*)").trim_end_matches(']');
            seen.entry(package.to_owned())
                .or_default()
                .insert(features.to_owned());
        }
    }
    seen.retain(|_, lists| lists.len() > 1);
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use super::is_unpacked;

    /// Seen failing with libc's `extra_traits` taken out of the hack crate: libc with
    /// `default,std` in some steps and `default,extra_traits,std` in others.
    #[test]
    fn every_step_builds_the_external_crates_with_the_same_features() {
        let varying = super::external_feature_variants().unwrap();
        assert!(
            varying.is_empty(),
            "the matrix's steps build these crates with different features, so each and \
             everything above it is built once per list: add the union to \
             crates/tt-workspace-hack/Cargo.toml: {varying:#?}"
        );
    }

    #[test]
    fn only_the_crates_own_unpacked_packages_are_recognised() {
        assert!(is_unpacked("tt-lock-0.1.0", "tt-lock"));
        assert!(is_unpacked("torchtools-cli-0.1.0", "torchtools-cli"));
        assert!(!is_unpacked("torchtools-cli-0.1.0", "torchtools"));
        assert!(!is_unpacked("tt-lockfree-1.0.0", "tt-lock"));
        assert!(!is_unpacked("tt-lock", "tt-lock"));
    }
}
