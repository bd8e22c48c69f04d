"""toma's ``toma.torch_cuda_memory``: freeing PyTorch's CUDA memory, what is free, and
which errors are an out-of-memory."""

from __future__ import annotations

import gc

import torch

from torchtools.toma._oom import oom_kind

__all__ = [
    "gc_cuda",
    "get_cuda_total_memory",
    "get_cuda_assumed_available_memory",
    "get_cuda_available_memory",
    "get_cuda_blocked_memory",
    "is_cuda_out_of_memory",
    "is_cudnn_snafu",
    "cuda_meminfo",
]


def gc_cuda() -> None:
    """Frees what Python and PyTorch's CUDA allocator hold unused."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_cuda_total_memory() -> int:
    """The first GPU's memory in bytes (0 without CUDA)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return 0


def get_cuda_assumed_available_memory() -> int:
    """The GPU's memory not reserved by this process's allocator (0 without CUDA)."""
    if torch.cuda.is_available():
        return get_cuda_total_memory() - torch.cuda.memory_reserved()
    return 0


def get_cuda_blocked_memory() -> int:
    """Memory of the GPU that this process cannot have although its allocator has not
    reserved it (other processes', the context's): what the driver reports as used
    beyond this allocator's reservation (0 without CUDA). toma finds it by allocating
    ever smaller blocks; the driver says it directly."""
    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info()
    return max(0, get_cuda_assumed_available_memory() - free)


def get_cuda_available_memory() -> int:
    """The GPU memory this process can still take (0 without CUDA)."""
    if torch.cuda.is_available():
        return get_cuda_assumed_available_memory() - get_cuda_blocked_memory()
    return 0


def is_cuda_out_of_memory(exception: BaseException) -> bool:
    """Whether ``exception`` is CUDA's out-of-memory (``torch.OutOfMemoryError``
    included), by torchtools' one classifier."""
    return oom_kind(exception) == "cuda"


def is_cudnn_snafu(exception: BaseException) -> bool:
    """Whether ``exception`` is cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` (which a smaller
    batch avoids; PyTorch issue 4107) or ``CUDNN_STATUS_ALLOC_FAILED``."""
    return oom_kind(exception) == "cudnn"


def cuda_meminfo() -> None:
    """Prints the allocator's memory now and at its peak, in GiB (nothing without CUDA)."""
    if not torch.cuda.is_available():
        return
    gib = 2**30
    print("Total:", torch.cuda.memory_allocated() / gib, " GB Cached: ", torch.cuda.memory_reserved() / gib, "GB")
    print(
        "Max Total:",
        torch.cuda.max_memory_allocated() / gib,
        " GB Max Cached: ",
        torch.cuda.max_memory_reserved() / gib,
        "GB",
    )
