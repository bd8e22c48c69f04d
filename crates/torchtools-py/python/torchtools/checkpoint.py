"""Verified checkpoints of a state dict: safetensors files (``safetensors.torch.load_file``
reads them) with a checksum of every tensor, written atomically and durably, in the
background if you like; loading verifies every byte. Backed by tt-ckpt."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from torchtools import _native

__all__ = ["save_state_dict", "save_state_dict_async", "load_state_dict"]


def _host(state_dict: Mapping[str, torch.Tensor], copy: bool):
    raw, keep = [], []
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise _native.BadRequestError(
                f"{name!r} is a {type(tensor).__name__}, not a tensor: put numbers and "
                "strings in values="
            )
        host = tensor.detach().to("cpu", copy=copy).contiguous()
        keep.append(host)
        raw.append(
            (
                name,
                str(host.dtype).replace("torch.", ""),
                list(host.shape),
                host.data_ptr(),
                host.numel() * host.element_size(),
            )
        )
    return raw, keep


def save_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    path: "str | os.PathLike[str]",
    step: int = 0,
    values: Optional[Dict[str, Any]] = None,
) -> None:
    """Writes ``state_dict`` (a model's or any flat dict of tensors) and the JSON
    ``values`` to ``path``: atomic (a crash leaves the old file or the new one) and
    durable when it returns."""
    raw, keep = _host(state_dict, copy=False)
    _native.save_checkpoint(os.fspath(path), int(step), raw, json.dumps(values or {}))
    del keep


def save_state_dict_async(
    state_dict: Mapping[str, torch.Tensor],
    path: "str | os.PathLike[str]",
    step: int = 0,
    values: Optional[Dict[str, Any]] = None,
) -> "_native.PendingSave":
    """Copies the tensors to host memory now and writes them on a thread of their own:
    training may change the originals at once. ``.wait()`` on the result returns when
    the file is durable (and raises what the write failed with)."""
    raw, keep = _host(state_dict, copy=True)
    return _native.save_checkpoint_async(os.fspath(path), int(step), raw, json.dumps(values or {}), keep)


def load_state_dict(
    path: "str | os.PathLike[str]", device: "str | torch.device" = "cpu"
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Reads and verifies a checkpoint: the state dict (on ``device``) and
    ``{"step": ..., "values": ...}``. A damaged file (a flipped byte, cut short, a
    tensor missing) raises ``TorchtoolsError`` saying what."""
    step, values, tensors = _native.load_checkpoint(os.fspath(path))
    state: Dict[str, torch.Tensor] = {}
    for name, dtype, shape, data in tensors:
        kind = getattr(torch, dtype)
        if len(data) == 0:
            tensor = torch.empty(shape, dtype=kind)
        else:
            tensor = torch.frombuffer(data, dtype=kind).reshape(shape)
        state[name] = tensor.to(device)
    return state, {"step": step, "values": json.loads(values)}
