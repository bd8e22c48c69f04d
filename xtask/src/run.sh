#!/usr/bin/env bash
# GPU tests of torchtools, built by `cargo xtask test-gpu --bundle`. Needs a machine with
# an NVIDIA GPU and PyTorch 2.11 installed (no Rust): libtorch is found through Python's
# torch (set PYTHON to choose the interpreter). `run.sh --bench [GROUP..]` runs the GPU
# benchmarks instead (all, or the groups named: fence, adaptive, tracker, training,
# trainer, models, optimizer, maxbatch, checkpoint, toolkit, toolkit-parts).
#
# Every test binary of the expected list below must be here and pass at least its
# minimum of tests; a test that cannot run on this machine (two GPUs on a one-GPU
# machine, MIG without a MIG device) prints `@@not-run NAME: WHY` and is counted apart,
# never as passed. Programs are counted apart too: one row each, passed when the
# program exits 0 and prints every line expected of it. Exit status 0 only when no row
# failed.
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
  exec "$here/bin/gpu_bench" "${@:2}"
fi

# name minimum: the test binaries, and the tests each must pass at least.
expected="__EXPECTED__"

tests=0; programs=0; not_run=0; failed_rows=0; rows=""; skipped=""; problems=""
elapsed() { awk -v s="$1" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }'; }
row() { rows="$rows$(printf '%-30s %6s %7s %6s %7s %8s  %s' "$@")\n"; }
problem() { problems="$problems  $1\n"; failed_rows=$((failed_rows + 1)); }

while read -r name minimum; do
  [ -n "$name" ] || continue
  t="$here/bin/$name"
  if [ ! -x "$t" ]; then
    row "$name" 0 0 1 "$minimum" 0 "MISSING"; problem "$name: missing from the bundle"; continue
  fi
  start=$(date +%s.%N)
  out=$("$t" --test-threads=1 --show-output 2>&1); rc=$?
  secs=$(elapsed "$start")
  echo "$out"
  line=$(echo "$out" | grep -E '^test result:' | tail -1)
  p=$(echo "$line" | sed -nE 's/.* ([0-9]+) passed.*/\1/p'); f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
  p=${p:-0}; f=${f:-0}
  nr=$(echo "$out" | grep -c '^@@not-run ')
  if [ "$nr" -gt 0 ]; then
    skipped="$skipped$(echo "$out" | grep '^@@not-run ' | sed "s/^@@not-run /  $name: /")\n"
  fi
  # A test that reports "not run" returned normally: libtest counted it as passed.
  p=$((p - nr)); [ "$p" -lt 0 ] && p=0
  verdict=ok
  if [ "$rc" -ne 0 ] || [ "$f" -gt 0 ]; then
    verdict=FAILED; [ "$f" -eq 0 ] && f=1; problem "$name: $f failed (exit status $rc)"
  elif [ "$p" -lt "$minimum" ]; then
    verdict="BELOW MINIMUM"; problem "$name: $p passed, fewer than its minimum $minimum"
  fi
  tests=$((tests + p)); not_run=$((not_run + nr))
  row "$name" "$p" "$nr" "$f" "$minimum" "$secs" "$verdict"
done <<EOF
$expected
EOF
# A test binary the list does not name would run unchecked: name it in the list.
for t in "$here"/bin/*-gpu; do
  [ -e "$t" ] || continue
  name=$(basename "$t")
  if ! echo "$expected" | grep -q "^$name "; then
    row "$name" 0 0 1 - 0 "NOT IN THE LIST"; problem "$name: not in run.sh's expected list"
  fi
done

# Whole programs on the GPU, one row each: `program NAME PATTERN.. -- COMMAND..`
# passes when COMMAND exits 0 and every PATTERN (an extended regex) matches a line.
work=$(mktemp -d)
program() {
  name=$1; shift
  patterns=()
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  start=$(date +%s.%N)
  echo "== $name: $*"
  out=$("$@" 2>&1); rc=$?
  echo "$out"
  secs=$(elapsed "$start")
  verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict=FAILED; problem "$name: exit status $rc"
  else
    for pat in "${patterns[@]}"; do
      if ! echo "$out" | grep -qE -- "$pat"; then
        verdict=FAILED; problem "$name: no line matches '$pat'"
      fi
    done
  fi
  if [ "$verdict" = ok ]; then programs=$((programs + 1)); row "$name" 1 0 0 1 "$secs" ok
  else row "$name" 0 0 1 1 "$secs" FAILED; fi
}
__PROGRAMS__
rm -rf "$work"

echo; printf '%-30s %6s %7s %6s %7s %8s  %s\n' "binary or program" passed "not run" failed minimum seconds verdict
printf '%b' "$rows"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
if [ -n "$skipped" ]; then echo "not run here (counted apart, never as passed):"; printf '%b' "$skipped"; fi
if [ -n "$problems" ]; then echo "failures:"; printf '%b' "$problems"; fi
echo "gpu-tests: $tests tests and $programs programs passed, $not_run not run, $failed_rows rows failed"
[ "$failed_rows" -eq 0 ] && [ "$tests" -gt 0 ] && [ "$programs" -gt 0 ]
