//! `cargo xtask test-gpu [--bundle DIR]`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::steps::cargo;
use crate::test::{gpu_test_args, GPU_CRATES};

const BUNDLE_LIMIT: u64 = 64 << 20;

/// Why there is no usable NVIDIA GPU here, if there is none.
fn no_gpu_reason() -> Option<String> {
    match Command::new("nvidia-smi").arg("-L").output() {
        Err(e) => Some(format!(
            "nvidia-smi cannot run ({e}): no NVIDIA driver on this machine"
        )),
        Ok(out) if !out.status.success() => Some(format!(
            "nvidia-smi failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(out)
            if !String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l.starts_with("GPU ")) =>
        {
            Some("nvidia-smi lists no GPU".into())
        }
        Ok(_) => None,
    }
}

/// Builds the GPU bundle into `target/gpu-bundle` and runs its `run.sh` here: the same
/// tests and programs, and the same table, as on a GPU machine without Rust.
pub(crate) fn run_gpu_tests() -> Result<()> {
    if let Some(why) = no_gpu_reason() {
        bail!("no usable GPU: {why}. `cargo xtask test-gpu` runs only where CUDA works; the CPU tests are `cargo xtask test`, and `cargo xtask test-gpu --bundle DIR` builds the GPU tests to run elsewhere");
    }
    let dir = crate::root().join("target/gpu-bundle");
    bundle(&dir)?;
    let mut run = Command::new("bash");
    run.arg(dir.join("run.sh"));
    // run.sh finds libtorch through Python's torch: the setup venv's, where it made one.
    if let crate::setup::Libtorch::Cached { venv } = crate::setup::setup()? {
        run.env("PYTHON", venv.join("bin/python"));
    }
    let status = run.status().context("cannot run run.sh")?;
    if !status.success() {
        bail!("GPU tests failed ({status}): see the table above");
    }
    Ok(())
}

/// Test executables that `cargo test --no-run --message-format=json` built.
fn built_executables(args: &[&str]) -> Result<Vec<PathBuf>> {
    let out = cargo(args).output().context("cargo did not start")?;
    if !out.status.success() {
        bail!(
            "building {args:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        // Test targets only: `cargo test -p torchtools-cli --no-run` also builds the
        // `torchtools` binary itself, which must not stand in for the tests.
        let is_test = msg["target"]["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == "test"))
            && msg["profile"]["test"] == true;
        if let (true, Some(exe)) = (is_test, msg.get("executable").and_then(|e| e.as_str())) {
            exes.push(PathBuf::from(exe));
        }
    }
    Ok(exes)
}

fn strip_into(src: &Path, dst: &Path) -> Result<()> {
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(dst)
        .arg(src)
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        _ => {
            fs::copy(src, dst).with_context(|| format!("cannot copy {}", src.display()))?;
            Ok(())
        }
    }
}

/// The bundle's `run.sh`, with its expected list and programs filled in.
const RUN_SH: &str = include_str!("run.sh");

/// A whole program that `run.sh` runs on the GPU: one row, passed when `command` exits
/// 0 and every pattern of `expect` (an extended regular expression) matches a line of
/// its output. `command` is shell text; `$here` is the bundle, `$work` a scratch folder.
pub(crate) struct Program {
    pub(crate) name: &'static str,
    pub(crate) expect: &'static [&'static str],
    pub(crate) command: &'static str,
}

/// The programs of the GPU bundle, in the order `run.sh` runs them.
pub(crate) const PROGRAMS: &[Program] = &[
    Program {
        name: "demo",
        expect: &[
            "selected +cuda:0",
            "batches of [0-9]+, [0-9]+ epochs on cuda:0",
            "reserved: \\[.*\\], fenced [1-9]",
            "held by pid [0-9]+",
            "probe of one training step \\(batch [0-9]+\\) in a fresh process, then: .*[1-9][0-9.]* [KMG]iB",
            "check: the resumed run's parameters are bit for bit",
            "check: 2 ranks on cuda:0 x [0-9]+ samples end where 1 process",
        ],
        command: "\"$here/bin/demo\" --out \"$work/demo\"",
    },
    Program {
        name: "train (launch 1, NCCL)",
        expect: &[
            "on Cuda\\(0\\), nccl backend",
            "precision full: forward in Float",
            "finished: [0-9]+ steps",
        ],
        command: "env TORCHTOOLS_TRAIN_EPOCHS=2 \"$here/bin/torchtools\" launch --nproc-per-node 1 -- \"$here/bin/train\"",
    },
    Program {
        name: "train (launch --gpu auto, NCCL)",
        expect: &[
            "on Cuda\\(0\\), nccl backend",
            "finished: [0-9]+ steps",
        ],
        command: "env TORCHTOOLS_TRAIN_EPOCHS=1 TORCHTOOLS_LOCK_DIR=\"$work/locks\" \"$here/bin/torchtools\" launch --gpu auto --bytes 8GiB --nproc-per-node 1 -- \"$here/bin/train\"",
    },
    Program {
        name: "train (launch 2, 1 GPU)",
        expect: &["on Cuda\\(0\\), gloo backend", "finished: [0-9]+ steps"],
        command: "env TORCHTOOLS_TRAIN_EPOCHS=2 \"$here/bin/torchtools\" launch --nproc-per-node 2 -- \"$here/bin/train\"",
    },
    Program {
        name: "train (bf16, 1 GPU)",
        expect: &[
            "on Cuda\\(0\\), one process",
            "precision bf16: forward in BFloat16",
            "best held-out loss [0-9]+\\.[0-9]+ at step",
        ],
        command: "env TORCHTOOLS_TRAIN_EPOCHS=1 TORCHTOOLS_TRAIN_PRECISION=bf16 \"$here/bin/train\"",
    },
    Program {
        name: "train (fp16, launch 1)",
        expect: &[
            "on Cuda\\(0\\), nccl backend",
            "precision fp16: forward in Half",
            "loss scale [0-9]+(\\.[0-9]+)?, [0-9]+ steps skipped",
            "best held-out loss [0-9]+\\.[0-9]+ at step",
        ],
        command: "env TORCHTOOLS_TRAIN_EPOCHS=1 TORCHTOOLS_TRAIN_PRECISION=fp16 \"$here/bin/torchtools\" launch --nproc-per-node 1 -- \"$here/bin/train\"",
    },
    Program {
        name: "Python package (pytest)",
        expect: &["^[0-9]+ passed in "],
        command: "\"$here/py/test.sh\" \"$work/py\"",
    },
    Program {
        name: "torchtools devices",
        expect: &["cuda:0 +nvml 0 +GPU-"],
        command: "\"$here/bin/torchtools\" devices",
    },
];

/// `s` as one single-quoted shell word.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `run.sh` with the expected test binaries (`NAME-gpu MINIMUM`) and the programs.
pub(crate) fn render_run_sh() -> String {
    let expected: Vec<String> = GPU_CRATES
        .iter()
        .map(|(krate, minimum)| format!("{krate}-gpu {minimum}"))
        .collect();
    let programs: Vec<String> = PROGRAMS
        .iter()
        .map(|p| {
            let patterns: Vec<String> = p.expect.iter().map(|e| shell_quote(e)).collect();
            format!(
                "program {} {} -- {}",
                shell_quote(p.name),
                patterns.join(" "),
                p.command
            )
        })
        .collect();
    RUN_SH
        .replace("__EXPECTED__", &expected.join("\n"))
        .replace("__PROGRAMS__", &programs.join("\n"))
}

pub(crate) fn bundle(dir: &Path) -> Result<()> {
    crate::setup::setup()?;
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    for (krate, _) in GPU_CRATES {
        let exes = built_executables(&gpu_test_args(
            krate,
            &["--no-run", "--message-format=json"],
        ))?;
        let [exe] = exes.as_slice() else {
            bail!(
                "cargo built {} GPU test binaries for {krate}, not one: {exes:?}",
                exes.len()
            );
        };
        strip_into(exe, &bin.join(format!("{krate}-gpu")))?;
    }
    crate::steps::run(
        "build the CLI (release)",
        cargo(&["build", "--release", "-p", "torchtools-cli"]),
    )?;
    strip_into(
        &crate::root().join("target/release/torchtools"),
        &bin.join("torchtools"),
    )?;
    // Whole programs: the main job and the unified trainer (run under `torchtools launch`).
    crate::steps::run(
        "build the demo and the trainer example",
        cargo(&[
            "build",
            "--example",
            "demo",
            "--example",
            "train",
            "--features",
            "dist",
        ]),
    )?;
    for example in ["demo", "train"] {
        strip_into(
            &crate::root().join("target/debug/examples").join(example),
            &bin.join(example),
        )?;
    }
    // The benchmarks as users build a training program: optimised (a debug build's
    // hashing of a checkpoint alone took seconds).
    crate::steps::run(
        "build the GPU benchmarks (release)",
        cargo(&[
            "build",
            "--release",
            "--example",
            "gpu_bench",
            "--features",
            "dist",
        ]),
    )?;
    strip_into(
        &crate::root().join("target/release/examples/gpu_bench"),
        &bin.join("gpu_bench"),
    )?;
    python_rows(&dir.join("py"))?;
    let run_sh = dir.join("run.sh");
    fs::write(&run_sh, render_run_sh())?;
    fs::set_permissions(&run_sh, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    // What travels: the bundle packed (its binaries shrink about 3 times).
    let name = dir
        .file_name()
        .context("the bundle's directory has no name")?;
    let packed = dir.with_extension("tar.gz");
    let status = Command::new("tar")
        .arg("czf")
        .arg(&packed)
        .arg("-C")
        .arg(dir.parent().unwrap_or(Path::new(".")))
        .arg(name)
        .status()
        .context("cannot run tar")?;
    if !status.success() {
        bail!("tar could not pack {} ({status})", dir.display());
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let size = fs::metadata(&packed)?.len();
    println!(
        "bundle: {} ({:.1} MiB; packed {:.1} MiB in {}): run `{}/run.sh` on a GPU machine",
        dir.display(),
        mib(du(dir)?),
        mib(size),
        packed.display(),
        dir.display()
    );
    if size > BUNDLE_LIMIT {
        bail!("the packed bundle is {size} bytes, over the 64 MiB that travels to the GPU machine");
    }
    Ok(())
}

/// The Python package's GPU rows in `py/`: the release wheel, the tests of
/// `crates/torchtools-py/tests_gpu`, toma 1.1.0's package from the setup venv (the
/// toma row's reference; the GPU machine has no network) and `test.sh`, which runs them.
fn python_rows(py: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(py);
    let tests = py.join("tests");
    fs::create_dir_all(&tests).with_context(|| format!("cannot create {}", tests.display()))?;
    let wheel = crate::wheel::build("release", &crate::root().join("target/wheels"))?;
    let name = wheel
        .file_name()
        .context("the wheel's path has no file name")?;
    fs::copy(&wheel, py.join(name))?;
    let source = crate::root().join("crates/torchtools-py/tests_gpu");
    for entry in fs::read_dir(&source)?.flatten() {
        if entry.path().extension().is_some_and(|e| e == "py") {
            fs::copy(entry.path(), tests.join(entry.file_name()))?;
        }
    }
    let crate::setup::Libtorch::Cached { venv } = crate::setup::setup()? else {
        bail!("the GPU bundle takes toma 1.1.0 from `cargo xtask setup`'s venv, and this setup made none");
    };
    let out = Command::new(venv.join("bin/python"))
        .args([
            "-c",
            "import os, toma; print(os.path.dirname(toma.__file__))",
        ])
        .output()
        .context("running the setup venv's python")?;
    if !out.status.success() {
        bail!("the setup venv has no toma: run `cargo xtask setup`");
    }
    let toma = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    copy_tree(&toma, &py.join("site/toma"))?;
    let script = py.join("test.sh");
    fs::write(&script, PY_TEST_SH)?;
    fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(())
}

/// The Python rows' runner (see `python_rows`).
const PY_TEST_SH: &str = include_str!("py-test.sh");

/// `src` copied into `dst`, Python's caches left out.
fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    fs::create_dir_all(dst)?;
    for entry in fs::read_dir(src)?.flatten() {
        let (from, to) = (entry.path(), dst.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            if entry.file_name() != "__pycache__" {
                copy_tree(&from, &to)?;
            }
        } else {
            fs::copy(&from, &to).with_context(|| format!("cannot copy {}", from.display()))?;
        }
    }
    Ok(())
}

/// Bytes of the files under `dir`.
fn du(dir: &Path) -> Result<u64> {
    let mut size = 0;
    for entry in fs::read_dir(dir)?.flatten() {
        size += match entry.file_type()?.is_dir() {
            true => du(&entry.path())?,
            false => entry.metadata()?.len(),
        };
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Lines the programs really printed on the GPU (H200, November 2026): the fake
    /// programs print them, so each row's patterns are checked against real output.
    const REAL_OUTPUT: &str = "\
  selected     cuda:0 (auto: CUDA is usable; one GPU is visible)
probe of one training step (batch 2048) in a fresh process, then: 956.00 MiB reserved for training; probe: probe on cuda:0 (GPU-b56fe413-9f6c-3fc6-b146-5045d37d753a): GPU memory, peak 896.00 MiB
  0  NVIDIA H200  GPU-b56fe413-9f6c-3fc6-b146-5045d37d753a: held by pid 1048 (root@vm) since 2026-11-25 15:22:45 UTC, reserving 956.00 MiB, fencing 138.30 GiB: demo
reserved: [ReservedGpu { key: Uuid(\"GPU-b56fe413-9f6c-3fc6-b146-5045d37d753a\"), ordinal: Some(0), fenced: Bytes(148502609920) }], fenced 138.30 GiB
16384 samples, batches of 2048, 3 epochs on cuda:0; Adam (tt-optim); checkpoint every 3 steps; tracker every 100 ms
  check: the resumed run's parameters are bit for bit the uninterrupted run's (checksum ebb11ef3760a0aeb)
  check: 2 ranks on cuda:0 x 1024 samples end where 1 process x 2048 does (largest difference 1.9e-8)
[rank0]: rank 0 of 1 (local rank 0), rendezvous 127.0.0.1:46629 (torchrun variables) on Cuda(0), nccl backend
[rank0]: rank 0 of 2 (local rank 0), rendezvous 127.0.0.1:39001 (torchrun variables) on Cuda(0), gloo backend
single process (no RANK / WORLD_SIZE / SLURM_PROCID set) on Cuda(0), one process
[rank0]: precision full: forward in Float
precision bf16: forward in BFloat16
[rank0]: precision fp16: forward in Half
[rank0]: loss scale 65536, 0 steps skipped (gradients not finite)
[rank0]: best held-out loss 0.00388 at step 128
[rank0]: finished: 128 steps
3 passed in 32.29s
  GPUs         cuda:0  nvml 0  GPU-b56fe413-9f6c-3fc6-b146-5045d37d753a  NVIDIA H200  140.40 GiB total
";

    fn script(path: &Path, body: &str) {
        fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A bundle whose test binaries pass their minimum (unless `binary` says otherwise
    /// for one: its script body, or `None` to leave it out) and whose programs print
    /// `programs`; `run.sh`'s exit status and output.
    fn run_fake(binary: Option<(&str, Option<&str>)>, programs: &str) -> (i32, String) {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        fs::create_dir(&bin).unwrap();
        fs::write(dir.path().join("run.sh"), render_run_sh()).unwrap();
        // run.sh asks Python where torch's libraries are; any answer will do here.
        script(&dir.path().join("python"), "echo /nonexistent");
        for (krate, minimum) in GPU_CRATES {
            let name = format!("{krate}-gpu");
            let body = match binary {
                Some((b, body)) if b == name => body.map(str::to_owned),
                _ => Some(format!(
                    "echo 'test result: ok. {minimum} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'"
                )),
            };
            if let Some(body) = body {
                script(&bin.join(&name), &body);
            }
        }
        if let Some((b, Some(body))) = binary {
            if !bin.join(b).exists() {
                script(&bin.join(b), body);
            }
        }
        fs::write(dir.path().join("programs.txt"), programs).unwrap();
        let cat = format!("cat '{}'", dir.path().join("programs.txt").display());
        for program in ["demo", "train", "torchtools"] {
            script(&bin.join(program), &cat);
        }
        fs::create_dir(dir.path().join("py")).unwrap();
        script(&dir.path().join("py/test.sh"), &cat);
        let out = Command::new("bash")
            .arg(dir.path().join("run.sh"))
            .env("PYTHON", dir.path().join("python"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code().unwrap_or(-1), text)
    }

    fn total_minimum() -> u32 {
        GPU_CRATES.iter().map(|(_, m)| m).sum()
    }

    #[test]
    fn every_row_passing_its_minimum_passes_and_the_patterns_match_real_output() {
        let (code, out) = run_fake(None, REAL_OUTPUT);
        assert_eq!(code, 0, "{out}");
        let want = format!(
            "gpu-tests: {} tests and {} programs passed, 0 not run, 0 rows failed",
            total_minimum(),
            PROGRAMS.len()
        );
        assert!(out.contains(&want), "{out}");
    }

    #[test]
    fn a_binary_below_its_minimum_or_missing_fails_the_run() {
        let zero =
            "echo 'test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'";
        let (code, out) = run_fake(Some(("tt-dist-gpu", Some(zero))), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains("tt-dist-gpu: 0 passed, fewer than its minimum"),
            "{out}"
        );
        let (code, out) = run_fake(Some(("tt-sys-gpu", None)), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("tt-sys-gpu: missing from the bundle"), "{out}");
        // A failed test, though the count reads high.
        let failed = "echo 'test result: FAILED. 9 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out'; exit 101";
        let (code, out) = run_fake(Some(("tt-ckpt-gpu", Some(failed))), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains("tt-ckpt-gpu: 1 failed (exit status 101)"),
            "{out}"
        );
        // A binary that dies before its summary line.
        let (code, out) = run_fake(Some(("tt-fence-gpu", Some("exit 134"))), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains("tt-fence-gpu: 1 failed (exit status 134)"),
            "{out}"
        );
    }

    #[test]
    fn a_test_not_run_here_is_counted_apart_never_as_passed() {
        let (_, minimum) = GPU_CRATES
            .iter()
            .find(|(k, _)| *k == "tt-dist")
            .copied()
            .unwrap();
        // libtest counts the returned test as passed; run.sh takes it back out.
        let body = format!(
            "echo '@@not-run two_nccl_ranks: two NCCL ranks need two GPUs; this machine has 1'\n\
             echo 'test result: ok. {} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'",
            minimum + 1
        );
        let (code, out) = run_fake(Some(("tt-dist-gpu", Some(&body))), REAL_OUTPUT);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains("  tt-dist-gpu: two_nccl_ranks: two NCCL ranks need two GPUs"),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "gpu-tests: {} tests and {} programs passed, 1 not run, 0 rows failed",
                total_minimum(),
                PROGRAMS.len()
            )),
            "{out}"
        );
        // At exactly the minimum, a test not run leaves the binary below it.
        let body = format!(
            "echo '@@not-run two_nccl_ranks: one GPU'\n\
             echo 'test result: ok. {minimum} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'"
        );
        let (code, out) = run_fake(Some(("tt-dist-gpu", Some(&body))), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("fewer than its minimum"), "{out}");
    }

    #[test]
    fn a_binary_outside_the_list_and_a_program_missing_a_line_fail_the_run() {
        let ok =
            "echo 'test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out'";
        let (code, out) = run_fake(Some(("tt-new-gpu", Some(ok))), REAL_OUTPUT);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains("tt-new-gpu: not in run.sh's expected list"),
            "{out}"
        );
        // The bf16 row without its dtype line (a run that did not use autocast).
        let without: String = REAL_OUTPUT
            .lines()
            .filter(|l| !l.contains("BFloat16"))
            .map(|l| format!("{l}\n"))
            .collect();
        let (code, out) = run_fake(None, &without);
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains(
                "train (bf16, 1 GPU): no line matches 'precision bf16: forward in BFloat16'"
            ),
            "{out}"
        );
        // A NaN evaluation is not a best held-out loss.
        let nan = REAL_OUTPUT.replace("loss 0.00388", "loss NaN");
        let (code, out) = run_fake(None, &nan);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("no line matches 'best held-out loss"), "{out}");
    }
}
