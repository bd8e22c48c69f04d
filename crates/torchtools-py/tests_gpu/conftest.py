"""The GPU rows' set-up (run by the GPU bundle's `run.sh`, never by the CPU suite):
each test gets its own lock directory; child Pythons see what users' machines do."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def a_gpu():
    """These tests are selected by `cargo xtask test-gpu`: without CUDA they fail."""
    assert torch.cuda.is_available(), "the GPU rows need CUDA: run them on a GPU machine"


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    d = tmp_path / "locks"
    d.mkdir()
    monkeypatch.setenv("TORCHTOOLS_LOCK_DIR", str(d))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return d


@pytest.fixture
def clean_env():
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    return env
