"""toma's ``toma.batchsize_cache``: the three cache types, passed as classes
(``cache_type=NoBatchsizeCache``); what each remembers is kept by torchtools' engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Batchsize",
    "BatchsizeCache",
    "GlobalBatchsizeCache",
    "NoBatchsizeCache",
    "StacktraceMemoryBatchsizeCache",
]


@dataclass
class Batchsize:
    """A size that halves (toma's ``Batchsize``)."""

    value: Optional[int] = None

    def set_initial_batchsize(self, initial_batchsize: int) -> None:
        if not self.value:
            self.value = initial_batchsize

    def get(self) -> Optional[int]:
        return self.value

    def decrease_batchsize(self) -> None:
        if not self.value or self.value < 2:
            raise ValueError(f"a batch size of {self.value} cannot be halved")
        self.value //= 2


class BatchsizeCache:
    """A cache type (toma's classes, used as markers: pass the class)."""


class StacktraceMemoryBatchsizeCache(BatchsizeCache):
    """The size is remembered per call stack and per 256 MiB of free CPU and GPU
    memory (toma's default)."""

    LRU_CACHE_SIZE: int = 2**16
    MEMORY_GRANULARITY: int = 2**28
    TRACK_RAM: bool = True


class GlobalBatchsizeCache(BatchsizeCache):
    """One size per function (or context), wherever it is called from."""


class NoBatchsizeCache(BatchsizeCache):
    """Nothing remembered: every call starts from its initial size."""
