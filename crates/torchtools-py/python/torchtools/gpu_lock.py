"""Cooperative GPU reservation: the Python torchtools' ``reserve_gpu_for_training``, on
torchtools' lock directory, fair queue and memory fences."""

from __future__ import annotations

import sys
import warnings
from typing import Optional, Sequence, Union

import torch

from torchtools import _native

#: Memory left free on top of ``training_reserved_bytes``: the Rust fence's own default,
#: read from the native module (50 MiB, as in the Python torchtools).
DEFAULT_SAFETY_MARGIN_BYTES: int = _native.DEFAULT_SAFETY_MARGIN_BYTES

Timeout = Union[None, int, float, str]
Gpu = Union[None, int, str, Sequence[Union[int, str]]]


def _seconds(timeout: Timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, str):
        try:
            return _native.parse_duration(timeout)
        except _native.BadRequestError as e:
            raise _native.BadRequestError(f"timeout={timeout!r}: {e}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise _native.BadRequestError(
            f"timeout={timeout!r}: give seconds (30), a duration ('10m') or None"
        )
    return float(timeout)


def _gpus(gpu: Gpu) -> list[str]:
    if gpu is None:
        return ["auto"]
    if isinstance(gpu, (int, str)):
        gpu = [gpu]
    if not isinstance(gpu, (list, tuple)):
        gpu = [gpu]
    out = []
    for g in gpu:
        if isinstance(g, bool) or not isinstance(g, (int, str)):
            raise _native.BadRequestError(
                f"gpu={g!r}: give an index (0), a UUID ('GPU-...'), 'cuda:N' or 'auto'"
            )
        out.append(str(g))
    return out


class GpuReservation:
    """GPUs held for this process: their locks, and fences that leave
    ``training_reserved_bytes + safety_margin_bytes`` free for the training, until the
    ``with`` block ends (also on an exception) or :meth:`release`.
    """

    def __init__(
        self,
        gpu: Gpu = None,
        training_reserved_bytes: int = 0,
        safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES,
        blocking: bool = True,
        timeout: Timeout = None,
        fence: bool = True,
        share: bool = False,
        count: Optional[int] = None,
    ) -> None:
        self._args = dict(
            gpus=_gpus(gpu),
            count=count,
            training_reserved_bytes=int(training_reserved_bytes),
            safety_margin_bytes=int(safety_margin_bytes),
            blocking=bool(blocking),
            timeout=_seconds(timeout),
            fence=bool(fence),
            share=bool(share),
            command=[sys.executable, *sys.argv],
        )
        self._held: Optional[_native.Reservation] = None

    def acquire(self) -> "GpuReservation":
        """Waits in the queue and takes the GPUs. A fence that cannot be raised (no
        NVML or no memory to fence) falls back to the lock alone with a warning, as the
        Python torchtools does."""
        try:
            self._held = _native.Reservation(**self._args)
        except _native.FenceError as e:
            if not self._args["fence"]:
                raise
            warnings.warn(f"{e}; holding the lock alone", RuntimeWarning, stacklevel=3)
            self._held = _native.Reservation(**{**self._args, "fence": False})
        return self

    @property
    def gpus(self) -> list[str]:
        """The GPUs held, as ``CUDA_VISIBLE_DEVICES`` names them (empty without GPUs)."""
        return self._held.gpus if self._held else []

    @property
    def cuda_visible_devices(self) -> str:
        return self._held.cuda_visible_devices if self._held else ""

    @property
    def device(self) -> torch.device:
        """The first reserved GPU as a torch device in this process, else the CPU."""
        ordinal = self._held.ordinal if self._held else None
        return torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)

    @property
    def fenced_bytes(self) -> int:
        return self._held.fenced_bytes if self._held else 0

    @property
    def held(self) -> bool:
        return bool(self._held and self._held.held)

    def release(self, exit_status: int = 0) -> None:
        """Lowers the fences, then releases the locks; ``exit_status`` goes into the
        usage records."""
        if self._held is not None:
            self._held.set_exit_status(int(exit_status))
            self._held.release()
            self._held = None

    def __enter__(self) -> "GpuReservation":
        return self.acquire()

    def __exit__(self, kind, value, traceback) -> None:
        self.release(0 if kind is None else 1)

    def __del__(self) -> None:
        held = getattr(self, "_held", None)
        if held is not None:
            held.release()


def reserve_gpu_for_training(
    gpu: Gpu = None,
    training_reserved_bytes: int = 0,
    safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES,
    blocking: bool = True,
    timeout: Timeout = None,
    fence: bool = True,
    share: bool = False,
    count: Optional[int] = None,
) -> GpuReservation:
    """Reserves GPU(s) for the training in the ``with`` block: the Python torchtools'
    context manager, on torchtools' fair queue::

        with reserve_gpu_for_training(gpu=0, training_reserved_bytes=6 * 1024**3) as r:
            model.to(r.device)

    ``gpu``: an index, a UUID, ``"cuda:N"``, a list of them, or ``None``/``"auto"`` (the
    free GPU with the most free memory; ``count`` of them). ``timeout``: seconds or a
    duration (``"10m"``); past it, ``GpuBusyError``. ``share=True``: share one GPU with
    other jobs by memory budget (``training_reserved_bytes``) instead of taking it
    alone. Ctrl-C while waiting raises ``KeyboardInterrupt`` and leaves nothing held.
    """
    return GpuReservation(
        gpu=gpu,
        training_reserved_bytes=training_reserved_bytes,
        safety_margin_bytes=safety_margin_bytes,
        blocking=blocking,
        timeout=timeout,
        fence=fence,
        share=share,
        count=count,
    )
