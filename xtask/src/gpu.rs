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

const RUN_SH: &str = r#"#!/usr/bin/env bash
# GPU tests of torchtools, built by `cargo xtask test-gpu --bundle`. Needs a machine with
# an NVIDIA GPU and PyTorch 2.11 installed (no Rust): libtorch is found through Python's
# torch (set PYTHON to choose the interpreter). Exit status: 0 only if every test passed
# and at least one ran. `run.sh --bench` runs the GPU benchmarks instead.
set -u
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
# The tests' reference Python (tt-testkit reads it; they fail, never guess, without it).
export TORCHTOOLS_PYTHON="$(command -v "$py" || echo "$py")"
torch_lib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null) || {
  echo "run.sh: '$py' cannot import torch: install PyTorch 2.11 or set PYTHON" >&2; exit 1; }
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TORCHTOOLS_BIN="$here/bin/torchtools"
if [ "${1:-}" = "--bench" ]; then
  # The probe's estimate against a real run's peak is the probe test's own figure.
  "$here/bin/tt-probe-gpu" --exact the_estimate_is_within_10_percent_above_a_real_runs_peak \
    --nocapture 2>&1 | grep -E 'estimate .* vs real' | sed 's/^/probe: /'
  exec "$here/bin/gpu_bench"
fi
pass=0; fail=0; rows=""
for t in "$here"/bin/*-gpu; do
  name=$(basename "$t")
  start=$(date +%s.%N)
  out=$("$t" --test-threads=1 --show-output 2>&1); rc=$?
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }')
  echo "$out"
  line=$(echo "$out" | grep -E '^test result:' | tail -1)
  p=$(echo "$line" | sed -nE 's/.* ([0-9]+) passed.*/\1/p'); f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
  p=${p:-0}; f=${f:-0}; [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
  pass=$((pass + p)); fail=$((fail + f))
  rows="$rows$(printf '%-28s %6s %6s %8s' "$name" "$p" "$f" "$secs")\n"
done
# Whole programs on the GPU, one row each (passed 1 when the program exits 0 and prints
# the line expected of it): the main job, and the unified trainer under `torchtools
# launch` with one rank (NCCL) and two ranks on one GPU (Gloo: NCCL refuses two ranks
# on one GPU).
work=$(mktemp -d)
program() {
  name=$1; expect=$2; shift 2
  start=$(date +%s.%N)
  echo "== $name: $*"
  out=$("$@" 2>&1); rc=$?
  echo "$out"
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }')
  p=1; f=0
  if [ "$rc" -ne 0 ]; then p=0; f=1; echo "$name: exit status $rc"
  elif ! echo "$out" | grep -qE "$expect"; then p=0; f=1; echo "$name: no line matches '$expect'"; fi
  pass=$((pass + p)); fail=$((fail + f))
  rows="$rows$(printf '%-28s %6s %6s %8s' "$name" "$p" "$f" "$secs")\n"
}
program demo 'selected +cuda:0' "$here/bin/demo" --out "$work/demo"
program "train (launch 1, NCCL)" 'on Cuda\(0\), nccl backend' env TORCHTOOLS_TRAIN_EPOCHS=2 \
  "$here/bin/torchtools" launch --nproc-per-node 1 -- "$here/bin/train"
program "train (launch 2, 1 GPU)" 'on Cuda\(0\), gloo backend' env TORCHTOOLS_TRAIN_EPOCHS=2 \
  "$here/bin/torchtools" launch --nproc-per-node 2 -- "$here/bin/train"
program "train (bf16, 1 GPU)" 'best held-out loss' env TORCHTOOLS_TRAIN_EPOCHS=1 \
  TORCHTOOLS_TRAIN_PRECISION=bf16 "$here/bin/train"
program "train (fp16, launch 1)" 'best held-out loss' env TORCHTOOLS_TRAIN_EPOCHS=1 \
  TORCHTOOLS_TRAIN_PRECISION=fp16 "$here/bin/torchtools" launch --nproc-per-node 1 -- "$here/bin/train"
program "torchtools devices" 'cuda:0 +nvml 0 +GPU-' "$here/bin/torchtools" devices
rm -rf "$work"
echo; printf '%-28s %6s %6s %8s\n' "binary" "passed" "failed" "seconds"; printf "$rows"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
echo "gpu-tests: $pass passed, $fail failed"
[ "$fail" -eq 0 ] && [ "$pass" -gt 0 ]
"#;

pub(crate) fn bundle(dir: &Path) -> Result<()> {
    crate::setup::setup()?;
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    for krate in GPU_CRATES {
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
            "--example",
            "gpu_bench",
            "--features",
            "dist",
        ]),
    )?;
    for example in ["demo", "train", "gpu_bench"] {
        strip_into(
            &crate::root().join("target/debug/examples").join(example),
            &bin.join(example),
        )?;
    }
    let run_sh = dir.join("run.sh");
    fs::write(&run_sh, RUN_SH)?;
    fs::set_permissions(&run_sh, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let mut size = 0;
    for entry in fs::read_dir(&bin)?.flatten() {
        size += entry.metadata()?.len();
    }
    size += fs::metadata(&run_sh)?.len();
    println!(
        "bundle: {} ({:.1} MiB): run `{}/run.sh` on a GPU machine",
        dir.display(),
        size as f64 / (1u64 << 20) as f64,
        dir.display()
    );
    if size > BUNDLE_LIMIT {
        bail!("the bundle is {size} bytes, over the 64 MiB that travels to the GPU machine");
    }
    Ok(())
}
