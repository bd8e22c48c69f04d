#!/usr/bin/env bash
# The Python package's GPU rows (`crates/torchtools-py/tests_gpu`), run by the GPU
# bundle's run.sh as one program: the wheel installed without a network beside the
# machine's PyTorch, toma 1.1.0 beside it (the reference of the toma row), then pytest.
# Usage: py/test.sh SCRATCH_DIR
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=${1:?usage: py/test.sh SCRATCH_DIR}
py=${PYTHON:-python3}
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$here"/*.whl
export PYTHONPATH="$work/site:$here/site${PYTHONPATH:+:$PYTHONPATH}"
# What users' machines do: Python's output is buffered unless they say not.
unset PYTHONUNBUFFERED
exec "$py" -m pytest -q -s -p no:cacheprovider "$here/tests"
