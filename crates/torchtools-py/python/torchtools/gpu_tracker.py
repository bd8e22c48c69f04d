"""gpu_tracker's ``Tracker`` (5.0.1), backed by torchtools' tracker: a drop-in, one
changed import line (``from gpu_tracker import Tracker`` becomes ``from
torchtools.gpu_tracker import Tracker``).

The same constructor, ``start()``/``stop()``, context manager, ``str(tracker)`` (its
report text), ``resource_usage`` (the same fields) and ``to_json()`` (the same keys).
What differs: the peaks are exact (the kernel's high-water marks, read as well as
sampled), so a spike between two samples is not missed; sampling runs on a thread of
this process, not in a second Python process.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, Optional, Set

from torchtools import _native

__all__ = ["Tracker"]


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value


class Tracker:
    """Tracks this process's (or ``process_id``'s) RAM, GPU RAM, CPU and GPU use and
    time, with its descendants, from ``start()`` (or ``with``) to ``stop()``."""

    def __init__(
        self,
        sleep_time: float = 1.0,
        ram_unit: str = "gigabytes",
        gpu_ram_unit: str = "gigabytes",
        time_unit: str = "hours",
        n_expected_cores: Optional[int] = None,
        gpu_uuids: Optional[Set[str]] = None,
        disable_logs: bool = False,
        process_id: Optional[int] = None,
        resource_usage_file: Optional[str] = None,
        n_join_attempts: int = 5,
        join_timeout: float = 10.0,
        gpu_brand: Optional[str] = None,
        tracking_file: Optional[str] = None,
        overwrite: bool = False,
    ) -> None:
        # resource_usage_file, n_join_attempts and join_timeout are about gpu_tracker's
        # second process; ours samples on a thread and needs none of them.
        if gpu_brand not in (None, "nvidia"):
            raise _native.BadRequestError(
                f"gpu_brand={gpu_brand!r}: torchtools reads NVIDIA GPUs (NVML) only"
            )
        self.disable_logs = disable_logs
        self._native = _native.Tracker(
            float(sleep_time),
            ram_unit,
            gpu_ram_unit,
            time_unit,
            n_expected_cores,
            sorted(gpu_uuids) if gpu_uuids is not None else None,
            process_id,
            os.fspath(tracking_file) if tracking_file is not None else None,
            bool(overwrite),
        )
        self.resource_usage: Optional[SimpleNamespace] = None

    def start(self) -> None:
        self._native.start()

    def stop(self) -> None:
        self._native.stop()
        self.resource_usage = _namespace(json.loads(self._native.json()))

    def __enter__(self) -> "Tracker":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def to_json(self) -> Dict[str, Any]:
        """The report as gpu_tracker's ``to_json()``: a dict of its keys."""
        return json.loads(self._native.json())

    def __str__(self) -> str:
        return self._native.text()

    def __repr__(self) -> str:
        return f"Tracker(resource_usage={'ready' if self.resource_usage else 'not stopped'})"
