//! `cargo xtask wheel`: the Python wheel `torchtools-cli` (maturin): the `torchtools`
//! command (and `gpu-tracker`) in its scripts, and the Python package `torchtools`
//! (`crates/torchtools-py`: the Python torchtools' and cycling_utils' APIs), so that
//! one `pip install` gives both; and the matrix step that installs such a wheel into a
//! fresh venv, runs the command from there and the package's pytest suite.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::steps::StepResult;

const MATURIN: &str = "maturin>=1.5,<2";

/// maturin, in a venv of its own in the torchtools cache (installed once).
fn maturin() -> Result<PathBuf> {
    let venv = crate::setup::cache_dir()?.join("maturin");
    let bin = venv.join("bin/maturin");
    if bin.exists() {
        return Ok(bin);
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!("`{python} -m venv {}` failed: install Python's venv module (Debian: apt-get install python3-venv)", venv.display());
    }
    let ok = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", MATURIN])
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !bin.exists() {
        bail!(
            "`pip install {MATURIN}` failed (see pip's message above): PyPI must be reachable once"
        );
    }
    Ok(bin)
}

/// The test wheel's extension gets tt-workspace-hack's features (torchtools-py's
/// `workspace-hack`), the features of the workspace's test builds.
pub(crate) const EXTENSION_TEST_FEATURES: [&str; 2] = ["--features", "workspace-hack"];

/// Builds the wheel with cargo's `profile` into `out`; returns its path: the command
/// first (cargo), put where the extension's pyproject takes the wheel's scripts from
/// (`target/wheel-data/scripts`), then the extension and the package (maturin).
pub(crate) fn build(profile: &str, out: &Path) -> Result<PathBuf> {
    let maturin = maturin()?;
    let _ = std::fs::remove_dir_all(out);
    // The test wheel (dev) is built with the test builds' features (the CLI's tests
    // and tt-workspace-hack), so cargo builds only what they have not.
    let test_wheel = profile == "dev";
    let status = Command::new(env!("CARGO"))
        .args(["build", "-q", "-p", "torchtools-cli", "--profile", profile])
        .args(if test_wheel {
            &crate::steps::CLI_TEST_FEATURES[..]
        } else {
            &[]
        })
        .current_dir(crate::root())
        .status()
        .context("starting cargo")?;
    if !status.success() {
        bail!("cargo build -p torchtools-cli failed ({status})");
    }
    let built = crate::root()
        .join("target")
        .join(if profile == "dev" { "debug" } else { profile });
    let scripts = crate::root().join("target/wheel-data/scripts");
    let _ = std::fs::remove_dir_all(&scripts);
    std::fs::create_dir_all(&scripts)?;
    for program in ["torchtools", "gpu-tracker"] {
        std::fs::copy(built.join(program), scripts.join(program))
            .with_context(|| format!("copying {} into the wheel's scripts", program))?;
    }
    // The man pages, installed under the environment's share/man/man1.
    let man = crate::root().join("target/wheel-data/data/share/man/man1");
    let _ = std::fs::remove_dir_all(&man);
    generate_man(&built.join("torchtools"), &man)?;
    let manifest = crate::root().join("crates/torchtools-py/Cargo.toml");
    // `linux`: a wheel for this machine's glibc. A wheel for PyPI is built the same way
    // in a manylinux container (`--compatibility manylinux_2_28`).
    let status = Command::new(&maturin)
        .args([
            "build",
            "--quiet",
            "--profile",
            profile,
            "--compatibility",
            "linux",
            "-m",
        ])
        .arg(&manifest)
        .args(if test_wheel {
            &EXTENSION_TEST_FEATURES[..]
        } else {
            &[]
        })
        .arg("-o")
        .arg(out)
        .current_dir(crate::root())
        .status()
        .with_context(|| format!("starting {}", maturin.display()))?;
    if !status.success() {
        bail!("maturin build failed ({status})");
    }
    std::fs::read_dir(out)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("maturin wrote no wheel into {}", out.display()))
}

/// Writes the man pages of `torchtools` (the binary at `bin`) into `dir`.
pub(crate) fn generate_man(bin: &Path, dir: &Path) -> Result<()> {
    let out = Command::new(bin)
        .arg("generate-man")
        .arg(dir)
        .output()
        .with_context(|| format!("starting {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "{} generate-man failed ({}): {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `cargo xtask man [DIR]`: the man pages of `torchtools` and each of its commands in
/// DIR (default `target/man`): `sudo cargo xtask man /usr/local/share/man/man1` is the
/// layout a root install expects (`man torchtools-reserve` then finds it).
pub(crate) fn man(dir: Option<&Path>) -> Result<()> {
    crate::steps::run(
        "cargo build -p torchtools-cli",
        crate::steps::cargo(&["build", "-q", "-p", "torchtools-cli", "--bin", "torchtools"]),
    )?;
    let dir = dir.map_or_else(|| crate::root().join("target/man"), Path::to_path_buf);
    generate_man(&crate::root().join("target/debug/torchtools"), &dir)?;
    println!(
        "man pages in {} (`man -l {}/torchtools.1`)",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// `cargo xtask wheel [--dev]`: a release wheel (or a quick debug one) in target/wheels.
pub(crate) fn run(dev: bool) -> Result<()> {
    let wheel = build(
        if dev { "dev" } else { "release" },
        &crate::root().join("target/wheels"),
    )?;
    println!("{}", wheel.display());
    eprintln!("install it with: pip install {}", wheel.display());
    Ok(())
}

const STEP: &str =
    "wheel: pip install into a fresh venv, run torchtools from it, pytest the Python package";

/// The matrix step: a (debug) wheel installed into a new venv; `torchtools track` and
/// `torchtools reserve` run from that venv's PATH on a Python command.
/// The matrix step.
pub(crate) fn check() -> StepResult {
    crate::steps::in_process(STEP, install_and_run)
}

pub(crate) fn install_and_run() -> Result<()> {
    let wheel = build("dev", &crate::root().join("target/wheels-test"))?;
    let tmp = std::env::temp_dir().join(format!("torchtools-wheel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = install_and_run_in(&wheel, &tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

/// A fresh venv in `tmp` with the wheel installed, checked: both commands on its
/// `bin`, the workspace's version; returns the venv.
fn install(wheel: &Path, tmp: &Path) -> Result<PathBuf> {
    let venv = tmp.join("venv");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()?;
    if !status.success() {
        bail!("`{python} -m venv` failed");
    }
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "--no-index"])
        .arg(wheel)
        .status()?;
    if !status.success() {
        bail!("pip install {} failed", wheel.display());
    }
    let bin = venv.join("bin");
    for program in ["torchtools", "gpu-tracker"] {
        if !bin.join(program).exists() {
            bail!("the wheel put no {program} into {}", bin.display());
        }
    }
    // The man pages, where `man` finds them for the environment's `torchtools`.
    let page = Command::new("man")
        .arg("torchtools-reserve")
        .env("MANPATH", venv.join("share/man"))
        .env("MANWIDTH", "80")
        .output()
        .context("starting man")?;
    if !page.status.success() || !String::from_utf8_lossy(&page.stdout).contains("Reserve GPUs") {
        bail!(
            "`man torchtools-reserve` with MANPATH={}/share/man: {}",
            venv.display(),
            String::from_utf8_lossy(&page.stderr)
        );
    }
    // The wheel's version is the crates' (maturin fills it in from Cargo.toml).
    let shown = Command::new(venv.join("bin/pip"))
        .args(["show", "torchtools-cli"])
        .output()?;
    let shown = String::from_utf8_lossy(&shown.stdout);
    let version = workspace_version()?;
    if !shown.lines().any(|l| l == format!("Version: {version}")) {
        bail!("the wheel's version is not the workspace's {version}: {shown}");
    }
    Ok(venv)
}

fn install_and_run_in(wheel: &Path, tmp: &Path) -> Result<()> {
    let venv = install(wheel, tmp)?;
    let bin = venv.join("bin");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |args: &[&str]| -> Result<String> {
        // `torchtools` by name: found on the venv's PATH, as after `source venv/bin/activate`.
        let out = Command::new("torchtools")
            .args(args)
            .env("PATH", &path)
            .env("TORCHTOOLS_LOCK_DIR", tmp.join("locks"))
            .env_remove("CUDA_VISIBLE_DEVICES")
            .current_dir(tmp)
            .output()
            .with_context(|| format!("running torchtools {args:?}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        print!("{stdout}");
        if !out.status.success() {
            bail!("torchtools {args:?} failed ({})", out.status);
        }
        Ok(stdout)
    };
    let tracked = run(&[
        "track",
        "--",
        "python",
        "-c",
        "print('tracked by the wheel')",
    ])?;
    if !tracked.contains("tracked by the wheel") || !tracked.contains("Max RAM") {
        bail!("torchtools track did not run the command and report on it");
    }
    // gpu_tracker's own command line, on the `gpu-tracker` the wheel installs.
    let out = Command::new("gpu-tracker")
        .args(["-e", "python -c print('tracked_by_gpu_tracker')"])
        .env("PATH", &path)
        .current_dir(tmp)
        .output()
        .context("running gpu-tracker")?;
    let said = String::from_utf8_lossy(&out.stdout);
    if !out.status.success()
        || !said.contains("tracked_by_gpu_tracker")
        || !said.contains("Max RAM")
    {
        bail!(
            "gpu-tracker -e ... did not run the command and report on it ({}): {said}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let reserved = run(&[
        "reserve",
        "--gpu",
        "0",
        "--no-fence",
        "--",
        "python",
        "-c",
        "import os; print('on', os.environ['CUDA_VISIBLE_DEVICES'])",
    ])?;
    if !reserved
        .lines()
        .any(|l| l.starts_with("on ") && l.len() > 3)
    {
        bail!("torchtools reserve did not hand the GPU to the Python command");
    }
    pytest(&venv)
}

/// The Python package's tests that must pass (skipped ones do not count): a test file
/// that stopped being collected fails the step. Raise it when tests are added.
const PYTEST_MIN_PASSED: u64 = 59;

/// The Python package's tests that need a Slurm cluster (`test_slurm.py`'s `cluster`):
/// they skip, and count as not passed, only where no cluster can start (not root, and
/// `TORCHTOOLS_TEST_NO_MOUNT` says why).
const PYTEST_SLURM_TESTS: u64 = 3;

/// The Slurm cluster of the Python package's tests (one node, two fake GPUs: the
/// real `sbatch`, `scancel` and `scontrol` that `test_slurm.py` runs), stopped when
/// dropped; `None` where it cannot start and `TORCHTOOLS_TEST_NO_MOUNT` says why.
fn slurm_cluster() -> Result<Option<tt_testkit::slurm::Cluster>> {
    if !tt_testkit::is_root() {
        return match std::env::var(tt_testkit::NO_MOUNT_ENV) {
            Ok(why) if !why.trim().is_empty() => {
                eprintln!(
                    "SKIPPED: the Python package's Slurm tests: a Slurm cluster needs root: {}",
                    why.trim()
                );
                Ok(None)
            }
            _ => bail!(
                "the Python package's Slurm tests need a Slurm cluster, whose daemons run as \
                 root: run `cargo xtask test` as root (as CI does), or set {}=<why> to skip \
                 them knowingly",
                tt_testkit::NO_MOUNT_ENV
            ),
        };
    }
    std::panic::catch_unwind(|| tt_testkit::slurm::Cluster::one_node(2)).map_err(|panic| {
        let said = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        anyhow::anyhow!("cannot start the Python tests' Slurm cluster: {said}")
    })
}

/// How long the Python package's tests may take (they take about 2 minutes).
const PYTEST_LIMIT: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The Python package's tests (`crates/torchtools-py/tests`), run by pytest in the
/// wheel's venv, which sees the reference venv's torch (and pytest) through a `.pth`
/// file: the package as installed, with the torch users have.
fn pytest(venv: &Path) -> Result<()> {
    let reference = std::env::var("TORCHTOOLS_PYTHON")
        .context("TORCHTOOLS_PYTHON is not set: run through cargo (`cargo xtask test`)")?;
    let out = Command::new(&reference)
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))",
        ])
        .output()
        .with_context(|| format!("running {reference}"))?;
    if !out.status.success() {
        bail!("{reference} cannot import torch: run `cargo xtask setup`");
    }
    let site_packages = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let ours = Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()?;
    let ours = PathBuf::from(String::from_utf8_lossy(&ours.stdout).trim());
    std::fs::write(
        ours.join("torchtools-reference-torch.pth"),
        format!("{site_packages}\n"),
    )?;
    let report = venv.join("pytest-report.xml");
    let _ = std::fs::remove_file(&report);
    let cluster = slurm_cluster()?;
    let mut pytest = Command::new(venv.join("bin/python"));
    if let Some(cluster) = &cluster {
        pytest.env(
            "TORCHTOOLS_TEST_SLURM_CONF",
            cluster.dir().join("slurm.conf"),
        );
    }
    let mut pytest = pytest
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=12",
        ])
        .arg(format!("--junitxml={}", report.display()))
        .arg(crate::root().join("crates/torchtools-py/tests"))
        // What users' machines do: Python's output is buffered unless they say not.
        .env_remove("PYTHONUNBUFFERED")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .current_dir(crate::root())
        .spawn()
        .context("starting pytest")?;
    // A hung test fails the step instead of holding CI until its own limit.
    let deadline = std::time::Instant::now() + PYTEST_LIMIT;
    let status = loop {
        if let Some(status) = pytest.try_wait()? {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = pytest.kill();
            let _ = pytest.wait();
            bail!(
                "the Python package's tests still ran after {PYTEST_LIMIT:?}: killed (a test \
                 hangs; pytest's progress above shows which file)"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    if !status.success() {
        bail!("the Python package's tests failed ({status}): see pytest's report above");
    }
    let xml = std::fs::read_to_string(&report)
        .with_context(|| format!("pytest wrote no report at {}", report.display()))?;
    let passed = junit_passed(&xml).context("pytest's report has no test counts")?;
    let min = if cluster.is_some() {
        PYTEST_MIN_PASSED
    } else {
        PYTEST_MIN_PASSED - PYTEST_SLURM_TESTS
    };
    if passed < min {
        bail!(
            "the Python package's tests: {passed} passed, fewer than the {min} \
             expected (skipped ones do not count): a test file is no longer collected, or \
             tests skip; lower PYTEST_MIN_PASSED in xtask/src/wheel.rs only for tests removed \
             on purpose"
        );
    }
    eprintln!("pytest: {passed} passed (at least {min} expected)");
    Ok(())
}

/// Tests passed in a JUnit XML report (pytest's `--junitxml`): its test suites'
/// `tests` less their `failures`, `errors` and `skipped`.
fn junit_passed(xml: &str) -> Option<u64> {
    let mut passed = 0u64;
    let mut found = false;
    for suite in xml.split("<testsuite ").skip(1) {
        let head = suite.split('>').next()?;
        let attribute = |name: &str| -> Option<u64> {
            let at = head.find(&format!(" {name}=\""))? + name.len() + 3;
            head[at..].split('"').next()?.parse().ok()
        };
        let tests = attribute("tests")?;
        let lost = attribute("failures")? + attribute("errors")? + attribute("skipped")?;
        passed += tests.saturating_sub(lost);
        found = true;
    }
    found.then_some(passed)
}

/// The workspace's version (`[workspace.package]` of the root Cargo.toml).
fn workspace_version() -> Result<String> {
    let manifest = std::fs::read_to_string(crate::root().join("Cargo.toml"))?;
    let section = manifest
        .split("[workspace.package]")
        .nth(1)
        .context("no [workspace.package] in Cargo.toml")?;
    section
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .context("no version in [workspace.package]")
}

#[cfg(test)]
mod tests {
    use super::junit_passed;

    #[test]
    fn skipped_failed_and_errored_tests_do_not_count_as_passed() {
        let xml = r#"<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="2" skipped="3" tests="50" time="1.0" timestamp="x" hostname="h"><testcase/></testsuite></testsuites>"#;
        assert_eq!(junit_passed(xml), Some(44));
        assert_eq!(junit_passed("<testsuites/>"), None);
    }
}
