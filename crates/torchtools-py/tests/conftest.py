"""Shared set-up: each test gets its own lock directory, and the `torchtools` command
the same wheel installed (beside this Python)."""

import os
import shutil
import sys

import pytest


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    d = tmp_path / "locks"
    d.mkdir()
    monkeypatch.setenv("TORCHTOOLS_LOCK_DIR", str(d))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return d


@pytest.fixture
def command():
    """The `torchtools` command of this venv (the wheel's)."""
    path = os.path.join(os.path.dirname(sys.executable), "torchtools")
    assert os.access(path, os.X_OK), f"the wheel put no torchtools beside {sys.executable}"
    return path


@pytest.fixture
def clean_env():
    """The environment of a child Python as users have it: unbuffered output is not
    the default on their machines."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    return env
