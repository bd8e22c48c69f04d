"""The package as users import it: its version, its device choice, its errors."""

import pathlib
import re

import pytest
import torch

import torchtools


def test_the_version_is_the_crates():
    cargo = pathlib.Path(__file__).resolve().parents[3] / "Cargo.toml"
    version = re.search(r'^version = "([^"]+)"', cargo.read_text(), re.M).group(1)
    assert torchtools.__version__ == version


def test_device_from_env_follows_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "cpu")
    assert torchtools.get_device_from_env() == torch.device("cpu")
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torchtools.get_device_from_env().type == expected


def test_a_bad_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "gpu please")
    with pytest.raises(torchtools.TorchtoolsError, match="TORCHTOOLS_DEVICE"):
        torchtools.get_device_from_env()
    # Ours are RuntimeErrors, as torch's own are.
    assert issubclass(torchtools.TorchtoolsError, RuntimeError)


def test_cuda_is_chosen_where_there_is_cuda_and_refused_elsewhere(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert torchtools.get_device_from_env().type == "cuda"
    else:
        with pytest.raises(torchtools.TorchtoolsError, match="CUDA"):
            torchtools.get_device_from_env()
