"""Verified state-dict checkpoints (safetensors that safetensors.torch reads, every byte
checked on load, saved in the background) and cycling_utils' AtomicDirectory."""

import os

import pytest
import torch
from safetensors.torch import load_file

from torchtools import BadRequestError, TorchtoolsError
from torchtools.checkpoint import load_state_dict, save_state_dict, save_state_dict_async
from torchtools.cycling_utils import AtomicDirectory


def model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    state["half"] = torch.randn(2, 2).to(torch.bfloat16)
    state["mask"] = torch.tensor([True, False])
    state["empty"] = torch.zeros(0, 3)
    return state


def test_a_state_dict_round_trips_and_safetensors_reads_it(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    state = model_state()
    save_state_dict(state, path, step=12, values={"lr": 3e-4, "epoch": 2})
    loaded, info = load_state_dict(path)
    assert info == {"step": 12, "values": {"lr": 3e-4, "epoch": 2}}
    theirs = load_file(str(path))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
        assert torch.equal(theirs[name], tensor), name
        assert loaded[name].dtype == tensor.dtype


def test_a_flipped_byte_is_caught_on_load(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_state_dict({"w": torch.arange(1000, dtype=torch.float32)}, path)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(TorchtoolsError, match="checksum"):
        load_state_dict(path)


def test_an_async_save_copies_first_then_writes(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    w = torch.ones(1 << 20)
    pending = save_state_dict_async({"w": w}, path, step=3)
    w.mul_(5)  # the training goes on at once
    pending.wait()
    assert pending.done
    loaded, info = load_state_dict(path)
    assert torch.equal(loaded["w"], torch.ones(1 << 20)) and info["step"] == 3
    # Dropped without a wait: the write still completes before the copies go.
    del pending
    pending = save_state_dict_async({"w": w}, path, step=4)
    del pending
    assert load_state_dict(path)[1]["step"] == 4


def test_what_is_not_a_tensor_is_refused(tmp_path):
    with pytest.raises(BadRequestError, match="not a tensor"):
        save_state_dict({"step": 3}, tmp_path / "x")
    assert os.listdir(tmp_path) == []


def test_atomic_directory_switches_to_each_new_checkpoint(tmp_path):
    saver = AtomicDirectory(tmp_path, is_master=True)
    assert saver.latest is None
    first = saver.prepare_checkpoint_directory()
    assert os.path.basename(first) == "CHK0"
    torch.save({"n": 0}, os.path.join(first, "model.pt"))
    saver.atomic_symlink(first)
    assert os.path.realpath(saver.latest) == os.path.realpath(first)
    second = saver.prepare_checkpoint_directory()
    assert os.path.basename(second) == "CHK1" and os.path.isdir(first)
    # A crash before the switch: the latest is still the first.
    assert torch.load(os.path.join(saver.latest, "model.pt")) == {"n": 0}
    torch.save({"n": 1}, os.path.join(second, "model.pt"))
    saver.atomic_symlink(second)
    third = saver.prepare_checkpoint_directory()
    # The one before the latest is cleaned up; the latest never is.
    assert sorted(os.listdir(tmp_path)) == ["CHK1", "CHK2", "latest_pt"]
    assert os.path.basename(third) == "CHK2"
    # Another rank writes nothing.
    other = AtomicDirectory(tmp_path, is_master=False)
    assert other.prepare_checkpoint_directory() is None
