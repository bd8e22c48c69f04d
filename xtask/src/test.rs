//! `cargo xtask test`: the CPU test matrix.

use anyhow::{bail, Result};

use crate::minimums::Minimums;
use crate::steps::{cargo, run_counted, summarize, StepResult, CLI_TEST_FEATURES};

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
/// `lower`: the test binaries (or steps) whose figures a recording may lower.
pub(crate) fn cpu_matrix(record: bool, lower: &[String]) -> Result<()> {
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
        let new = Minimums::of(&results);
        if path.exists() {
            Minimums::read()?.check_lowering(&new, lower)?;
        }
        std::fs::write(&path, new.render(&order))?;
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

/// The clippy commands: the workspace with the GPU test targets, then each crate
/// without its features (clippy's own arguments after `--`).
fn clippy_plan() -> Vec<(String, Vec<String>)> {
    // One workspace-wide lint, GPU test targets included: every configuration of
    // features costs a rebuild of torch-sys's C++ (about 2.5 minutes on 2 cores).
    let gpu_features = GPU_CRATES.map(|(k, _)| format!("{k}/gpu-tests")).join(",");
    let mut plan = vec![(
        "clippy --workspace --all-targets (+ GPU tests) -D warnings".into(),
        owned(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            &gpu_features,
            "--",
            "-D",
            "warnings",
        ]),
    )];
    for krate in CRATES {
        plan.push((
            format!("clippy -p {krate} --no-default-features"),
            owned(&[
                "clippy",
                "-p",
                krate,
                "--all-targets",
                "--no-default-features",
                "--",
                "-D",
                "warnings",
            ]),
        ));
    }
    plan
}

/// The docs of every crate, with tt-dist's c10d (`RUSTDOCFLAGS=-D warnings`).
const DOC_ARGS: [&str; 5] = [
    "doc",
    "--workspace",
    "--no-deps",
    "--features",
    "tt-dist/c10d",
];

/// Clippy ([`clippy_plan`]), the GPU tests linked, the docs with warnings denied.
fn lint_steps(results: &mut Vec<StepResult>) {
    for (name, args) in clippy_plan() {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        results.push(run_counted(&name, cargo(&args)));
    }
    for (krate, _) in GPU_CRATES {
        results.push(run_counted(
            &format!("build GPU tests of {krate} (link only)"),
            cargo(&gpu_test_args(krate, &["--no-run"])),
        ));
    }
    let mut doc = cargo(&DOC_ARGS);
    doc.env("RUSTDOCFLAGS", "-D warnings");
    results.push(run_counted("doc --workspace (warnings denied)", doc));
}

/// Command-line arguments as owned strings.
fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
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
            "--exclude",
            "tt-workspace-hack",
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
    // And the CLI does not even link libtorch. Built with its tests' features (a
    // superset of what users build, so no libtorch here means none there), it is the
    // command the CLI's test step already built.
    let built = cargo(&["build", "-p", "torchtools-cli"])
        .args(CLI_TEST_FEATURES)
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

/// Every cargo command of `cargo xtask test` that builds into the workspace's
/// `target/debug`: the test steps, clippy, the GPU tests' link, the docs, the CLI of
/// the facade's tests and of the test wheel, and the wheel's extension (cargo's own
/// arguments only).
#[cfg(test)]
fn builds_sharing_target_debug() -> Vec<(String, Vec<String>)> {
    let mut all: Vec<(String, Vec<String>)> = test_plan()
        .into_iter()
        .map(|(name, args)| (name, owned(&args)))
        .collect();
    for (name, mut args) in clippy_plan() {
        if let Some(end) = args.iter().position(|a| a == "--") {
            args.truncate(end);
        }
        all.push((name, args));
    }
    for (krate, _) in GPU_CRATES {
        all.push((
            format!("build GPU tests of {krate}"),
            owned(&gpu_test_args(krate, &["--no-run"])),
        ));
    }
    all.push(("doc".into(), owned(&DOC_ARGS)));
    let mut cli = owned(&["build", "-p", "torchtools-cli"]);
    cli.extend(owned(&CLI_TEST_FEATURES));
    all.push((
        "the CLI for the facade's tests and the test wheel".into(),
        cli,
    ));
    // The test wheel's extension (maturin runs `cargo rustc` for it with these).
    let mut extension = owned(&["build", "-p", "torchtools-py", "--lib"]);
    extension.extend(owned(&crate::wheel::EXTENSION_TEST_FEATURES));
    all.push(("the wheel's extension".into(), extension));
    all
}

/// The external crates that [`builds_sharing_target_debug`] build more than once: the
/// same crate, target and mode with other features, or above another build of one of
/// its dependencies (a build script's libc, ...), and so built again with everything
/// above it (torch-sys's C++, tch). Read from cargo's unit graph (`--unit-graph`, an
/// unstable flag: `RUSTC_BOOTSTRAP=1` for this check only; nothing is built). A crate
/// may have two builds within one command (one for build scripts and proc-macros, one
/// for the tests); more across the commands than within any one is reported, with
/// each build's features and the first commands that use it. The `tt-workspace-hack`
/// crate gives every command the same features, build side included.
#[cfg(test)]
fn external_feature_variants() -> Result<std::collections::BTreeMap<String, Vec<String>>> {
    use anyhow::Context;
    use std::collections::{BTreeMap, BTreeSet, HashMap};
    // crate, target and mode -> build -> (features, commands); and the most builds of
    // it that one command has.
    type Builds = BTreeMap<u64, (String, Vec<String>)>;
    let mut seen: BTreeMap<String, Builds> = BTreeMap::new();
    let mut most_in_one: HashMap<String, usize> = HashMap::new();
    for (name, args) in builds_sharing_target_debug() {
        let out = cargo(&args.iter().map(String::as_str).collect::<Vec<_>>())
            .args(["--unit-graph", "-Z", "unstable-options"])
            .env("RUSTC_BOOTSTRAP", "1")
            .output()
            .context("running cargo --unit-graph")?;
        if !out.status.success() {
            bail!(
                "cargo {args:?} --unit-graph: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let graph: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let units = graph["units"].as_array().context("no units")?;
        let mut memo = HashMap::new();
        let mut here: HashMap<String, BTreeSet<u64>> = HashMap::new();
        for (i, unit) in units.iter().enumerate() {
            let pkg = unit["pkg_id"].as_str().unwrap_or_default();
            let mode = unit["mode"].as_str().unwrap_or_default();
            // Only what is built (clippy's checks are its own), of crates.io's crates.
            if !pkg.starts_with("registry+") || !["build", "run-custom-build"].contains(&mode) {
                continue;
            }
            let id = unit_identity(units, i, &mut memo);
            let what = format!(
                "{} {} {mode}",
                pkg.rsplit('#').next().unwrap_or(pkg),
                unit["target"]["kind"]
            );
            here.entry(what.clone()).or_default().insert(id);
            let build = seen.entry(what).or_default().entry(id).or_default();
            build.0 = unit["features"].to_string();
            if build.1.len() < 3 {
                build.1.push(name.clone());
            }
        }
        for (what, ids) in here {
            let most = most_in_one.entry(what).or_default();
            *most = (*most).max(ids.len());
        }
    }
    Ok(seen
        .into_iter()
        .filter(|(what, builds)| builds.len() > most_in_one.get(what).copied().unwrap_or(0))
        .map(|(what, builds)| {
            let lists = builds
                .into_values()
                .map(|(features, commands)| format!("{features} in {}", commands.join(", ")))
                .collect();
            (what, lists)
        })
        .collect())
}

/// A build's identity in cargo's unit graph: what it is, its features and profile (but
/// the profile's name: cargo test and cargo build share them), and its dependencies'
/// identities.
#[cfg(test)]
fn unit_identity(
    units: &[serde_json::Value],
    i: usize,
    memo: &mut std::collections::HashMap<usize, u64>,
) -> u64 {
    use std::hash::{Hash, Hasher};
    if let Some(&id) = memo.get(&i) {
        return id;
    }
    let unit = &units[i];
    let mut profile = unit["profile"].clone();
    if let Some(p) = profile.as_object_mut() {
        p.remove("name");
    }
    let mut deps: Vec<u64> = unit["dependencies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["index"].as_u64())
        .map(|d| unit_identity(units, d as usize, memo))
        .collect();
    deps.sort_unstable();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for key in ["pkg_id", "mode", "features", "platform"] {
        unit[key].to_string().hash(&mut h);
    }
    unit["target"]["kind"].to_string().hash(&mut h);
    unit["target"]["name"].to_string().hash(&mut h);
    profile.to_string().hash(&mut h);
    deps.hash(&mut h);
    let id = h.finish();
    memo.insert(i, id);
    id
}

#[cfg(test)]
mod tests {
    use super::is_unpacked;

    /// Seen failing with libc's `extra_traits` taken out of the hack crate's
    /// dependencies (libc with `default,std` in some steps and
    /// `default,extra_traits,std` in others), and with it taken out of its
    /// build-dependencies (clippy's build scripts' libc: jobserver, cc and torch-sys's
    /// build script built again).
    #[test]
    fn every_step_builds_the_external_crates_with_the_same_features() {
        let varying = super::external_feature_variants().unwrap();
        assert!(
            varying.is_empty(),
            "`cargo xtask test`'s commands build these crates more than once, and each \
             time everything above them: add the union of their features to \
             crates/tt-workspace-hack/Cargo.toml ([dependencies], or \
             [build-dependencies] for builds that scripts and proc-macros use): \
             {varying:#?}"
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
