"""toma's ``toma.cpu_memory``: the memory this process may still take, a limit on it
(``set_cpu_memory_limit``, for tests), and the CPU allocator's out-of-memory. From
``/proc`` and ``resource``: no psutil needed."""

from __future__ import annotations

import resource

from torchtools.toma._oom import oom_kind

__all__ = ["get_available_cpu_memory", "set_cpu_memory_limit", "is_out_of_cpu_memory"]


def _proc_value(path: str, key: str) -> int:
    """A ``key: N kB`` line of ``path`` in bytes (0 when it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def get_available_cpu_memory() -> int:
    """Bytes this process may still take: the machine's available memory
    (``MemAvailable``), and no more than its address-space limit leaves."""
    available = _proc_value("/proc/meminfo", "MemAvailable")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        used = _proc_value("/proc/self/status", "VmSize")
        available = min(hard - used, available)
    return available


def set_cpu_memory_limit(num_gigabytes: float) -> None:
    """Limits this process's address space to ``num_gigabytes`` GiB (``RLIMIT_AS``, soft
    and hard; never raised above a hard limit already set): allocations past it fail
    with the CPU allocator's out-of-memory."""
    if num_gigabytes <= 0:
        raise ValueError(f"a memory limit of {num_gigabytes} GiB: give more than 0")
    limit = int(num_gigabytes * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def is_out_of_cpu_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is PyTorch's CPU allocator running out of memory, by
    torchtools' one classifier."""
    return oom_kind(exception) == "cpu"
