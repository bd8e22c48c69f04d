"""The README's Python example runs as written."""

import os
import pathlib
import re
import subprocess
import sys


def test_the_readme_example_runs(lock_dir, tmp_path, clean_env):
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert blocks, "the README has no Python example"
    for code in blocks:
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**clean_env, "TORCHTOOLS_LOCK_DIR": str(lock_dir)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
    assert (tmp_path / "latest.pt").exists()
