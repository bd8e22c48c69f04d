"""Probes and the probe-then-reserve flow: the Python torchtools'
``estimate_gpu_usage_by_probe``, ``make_probe_fn`` and ``run_training_with_reservation``.
"""

from __future__ import annotations

import multiprocessing
import queue as _queue
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from torchtools import _native
from torchtools.gpu_lock import reserve_gpu_for_training


class _Probe:
    """A picklable probe: builds a model and runs ``warmup_steps`` forward and backward
    passes on a batch of ``input_shape`` (or ``sample_batch``) on ``device``."""

    def __init__(
        self,
        model_fn: Optional[Callable[[], torch.nn.Module]],
        input_shape: Sequence[int],
        warmup_steps: int,
        sample_batch: Any,
    ) -> None:
        self.model_fn = model_fn
        self.input_shape = tuple(input_shape)
        self.warmup_steps = warmup_steps
        self.sample_batch = sample_batch

    def __call__(self, device: torch.device) -> None:
        if self.model_fn is not None:
            model = self.model_fn()
        else:
            channels = self.input_shape[1] if len(self.input_shape) > 1 else 1
            model = torch.nn.Sequential(
                torch.nn.Conv2d(channels, 64, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(64, 10),
            )
        model = model.to(device)
        batch = self.sample_batch
        if batch is None:
            batch = torch.randn(*self.input_shape)
        batch = batch.to(device)
        for _ in range(self.warmup_steps):
            model.zero_grad(set_to_none=True)
            model(batch).float().sum().backward()


def make_probe_fn(
    model_fn: Optional[Callable[[], torch.nn.Module]] = None,
    input_shape: Sequence[int] = (16, 3, 224, 224),
    warmup_steps: int = 1,
    sample_batch: Any = None,
) -> Callable[[torch.device], None]:
    """A probe for :func:`estimate_gpu_usage_by_probe`: ``model_fn`` (a top-level,
    picklable callable building the model; default a small CNN) run for
    ``warmup_steps`` forward and backward passes on ``sample_batch`` or random input of
    ``input_shape``."""
    if warmup_steps < 1:
        raise _native.BadRequestError(f"warmup_steps={warmup_steps}: give 1 or more")
    return _Probe(model_fn, input_shape, warmup_steps, sample_batch)


def _run_probe(probe_fn, device_name, answers) -> None:
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.reset_peak_memory_stats(device)
        probe_fn(device)
        peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        answers.put(("ok", int(peak)))
    except BaseException as e:  # the parent says what failed
        answers.put(("error", f"{type(e).__name__}: {e}"))


def estimate_gpu_usage_by_probe(
    probe_fn: Callable[[torch.device], None],
    device: Optional[torch.device] = None,
    timeout: Optional[float] = 600.0,
) -> int:
    """Runs ``probe_fn(device)`` in a fresh process (multiprocessing's spawn: it must be
    picklable) and returns the peak GPU memory it reserved through PyTorch's allocator,
    in bytes (0 on the CPU). A probe that fails or overruns ``timeout`` raises
    ``TorchtoolsError`` with its error; nothing is guessed."""
    if device is None:
        from torchtools.device import get_device_from_env

        device = get_device_from_env()
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    child = ctx.Process(target=_run_probe, args=(probe_fn, str(device), answers))
    child.start()
    try:
        kind, value = answers.get(timeout=timeout)
    except _queue.Empty:
        child.kill()
        raise _native.TorchtoolsError(
            f"the probe did not finish within {timeout} s: give a shorter probe "
            "(fewer warmup_steps) or a longer timeout"
        ) from None
    finally:
        child.join(timeout=30)
    if kind != "ok":
        raise _native.TorchtoolsError(f"the probe failed: {value}")
    return value


def run_training_with_reservation(
    train_fn: Callable[..., Any],
    train_args: Sequence[Any] = (),
    train_kwargs: Optional[Mapping[str, Any]] = None,
    probe_fn: Optional[Callable[[torch.device], None]] = None,
    reserve_kwargs: Optional[Mapping[str, Any]] = None,
) -> Any:
    """Probes (when ``probe_fn`` is given) to size the reservation, reserves, runs
    ``train_fn(*train_args, **train_kwargs)`` inside it and returns its result; the
    GPUs are released however it ends."""
    kwargs = dict(reserve_kwargs or {})
    if probe_fn is not None and "training_reserved_bytes" not in kwargs:
        kwargs["training_reserved_bytes"] = estimate_gpu_usage_by_probe(probe_fn)
    with reserve_gpu_for_training(**kwargs):
        return train_fn(*train_args, **dict(train_kwargs or {}))
