"""Device choice: the Python torchtools' ``get_device_from_env``."""

from __future__ import annotations

import torch

from torchtools import _native


def _cuda_free() -> tuple[list[int | None], str | None]:
    """Free bytes of each CUDA device torch sees, or why CUDA is not usable."""
    if not torch.cuda.is_available():
        return [], "torch.cuda.is_available() is False"
    free: list[int | None] = []
    for i in range(torch.cuda.device_count()):
        try:
            free.append(int(torch.cuda.mem_get_info(i)[0]))
        except RuntimeError:
            free.append(None)
    return free, None


def _mps_unusable() -> str | None:
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return None
    return "torch.backends.mps.is_available() is False"


def get_device_from_env() -> torch.device:
    """The device this process should train on, chosen as every torchtools tool chooses:
    ``TORCHTOOLS_DEVICE`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``), under a
    launcher ``cuda:LOCAL_RANK``, else the CUDA device with the most free memory, else
    MPS, else the CPU. A bad variable, or a device that is not there, raises
    ``TorchtoolsError`` naming it.
    """
    free, cuda_unusable = _cuda_free()
    name, _reason = _native.select_device(free, cuda_unusable, _mps_unusable())
    return torch.device(name)
