"""toma's API (1.1.0), backed by torchtools' OOM-adaptive engine: a drop-in, one changed
import line (``from toma import toma`` becomes ``from torchtools.toma import toma``).

``toma.batch``, ``toma.range`` and ``toma.chunked`` as decorators, ``toma.execute.*``,
``explicit.*`` and ``simple.*``, toma's three caches and its rule for what is an
out-of-memory, and its modules (``batchsize_cache``, ``cpu_memory`` with
``set_cpu_memory_limit``, ``torch_cuda_memory``, ``stacktrace``): every import line of
toma's README and tests has its counterpart here. By default the sizes are toma's,
exactly (its own tests pass unchanged). What differs, by design:

- One keyword away, ``policy="search"`` (or ``DEFAULT_POLICY = "search"``): after an
  out-of-memory the size is remembered per call stack and free memory (as toma does),
  and later calls search back up toward the largest size that fits instead of staying
  at the halved one.
- Memory is freed (``gc.collect()``, ``torch.cuda.empty_cache()``) after an
  out-of-memory, not around every call and every step: toma's cost on calls that fit.
- The call stack is read from the frames (file and line), not with
  ``inspect.stack()``, which reads every source file's lines at every call.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any, Callable, Optional, Type

import torch

from torchtools import _native
from torchtools.toma import batchsize_cache, cpu_memory, stacktrace, torch_cuda_memory
from torchtools.toma.batchsize_cache import (
    BatchsizeCache,
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
)
from torchtools.toma.cpu_memory import get_available_cpu_memory, is_out_of_cpu_memory
from torchtools.toma._oom import oom_kind
from torchtools.toma.stacktrace import get_simple_traceback
from torchtools.toma.torch_cuda_memory import (
    gc_cuda,
    get_cuda_assumed_available_memory,
    is_cuda_out_of_memory,
    is_cudnn_snafu,
)

__all__ = [
    "toma",
    "explicit",
    "simple",
    "DEFAULT_CACHE_TYPE",
    "DEFAULT_POLICY",
    "StacktraceMemoryBatchsizeCache",
    "GlobalBatchsizeCache",
    "NoBatchsizeCache",
    "should_reduce_batch_size",
    "gc_cuda",
    "batchsize_cache",
    "cpu_memory",
    "stacktrace",
    "torch_cuda_memory",
]


DEFAULT_CACHE_TYPE: Type[BatchsizeCache] = StacktraceMemoryBatchsizeCache
#: "halve" (toma's rule, the default: toma's own tests pass unchanged) or "search"
#: (after an out-of-memory, search back up toward the largest size that fits).
DEFAULT_POLICY: str = "halve"

_ENGINES: dict = {}


def _engine(cache_type: Type[BatchsizeCache], policy: Optional[str]) -> "_native.Adaptive":
    policy = policy or DEFAULT_POLICY
    remember = not (isinstance(cache_type, type) and issubclass(cache_type, NoBatchsizeCache))
    key = (policy, remember)
    if key not in _ENGINES:
        _ENGINES[key] = _native.Adaptive(policy, remember)
    return _ENGINES[key]


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether a smaller batch may avoid ``exception``: toma's rule (CUDA's out-of-memory,
    ``torch.OutOfMemoryError`` included; cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``; the CPU
    allocator's "can't allocate memory"), asked of torchtools' one classifier, which
    also knows cuDNN's and cuBLAS's allocation failures and MPS's out-of-memory."""
    return oom_kind(exception) is not None


def _context_key(context: Any) -> str:
    if callable(context) and hasattr(context, "__qualname__"):
        return f"{getattr(context, '__module__', '?')}.{context.__qualname__}#{id(context)}"
    return repr(context)


def _key(cache_type: Type[BatchsizeCache], context: Any, skip: int) -> str:
    key = f"{getattr(cache_type, '__name__', cache_type)}|{_context_key(context)}"
    if isinstance(cache_type, type) and issubclass(cache_type, StacktraceMemoryBatchsizeCache):
        unit = cache_type.MEMORY_GRANULARITY
        cpu = get_available_cpu_memory() // unit if cache_type.TRACK_RAM else -1
        gpu = get_cuda_assumed_available_memory() // unit
        key += f"|{hash(get_simple_traceback(skip + 1))}|{cpu}|{gpu}"
    return key


def _attempt(call: Callable[..., Any], size_of: Callable[..., int]) -> Callable[..., Any]:
    """An attempt as the engine runs it: ``(True, value)``, or ``(False, exception)``
    after an out-of-memory (its frames let go and memory freed first)."""

    def attempt(*sizes):
        try:
            return (True, call(*sizes))
        except RuntimeError as exception:
            if size_of(*sizes) > 1 and should_reduce_batch_size(exception):
                # The failed frames hold the tensors that ran out: let them go.
                traceback.clear_frames(exception.__traceback__)
                gc_cuda()
                return (False, exception)
            raise

    return attempt


class explicit:
    """Explicit calls (toma's ``explicit``): the function and its arguments given."""

    @staticmethod
    def batch(
        func,
        initial_batchsize: int,
        *args,
        toma_context=None,
        toma_cache_type: Type[BatchsizeCache] = None,
        toma_policy: Optional[str] = None,
        **kwargs,
    ):
        cache_type = toma_cache_type or DEFAULT_CACHE_TYPE
        key = _key(cache_type, toma_context or func, 1)
        attempt = _attempt(lambda size: func(size, *args, **kwargs), lambda size: size)
        return _engine(cache_type, toma_policy).batch(key, initial_batchsize, attempt)

    @staticmethod
    def range(
        func,
        start: int,
        end: int,
        initial_step: int,
        *args,
        toma_context=None,
        toma_cache_type: Type[BatchsizeCache] = None,
        toma_policy: Optional[str] = None,
        **kwargs,
    ):
        cache_type = toma_cache_type or DEFAULT_CACHE_TYPE
        key = _key(cache_type, toma_context or func, 1)
        attempt = _attempt(
            lambda lo, hi: func(lo, hi, *args, **kwargs), lambda lo, hi: hi - lo
        )
        _engine(cache_type, toma_policy).range(key, start, end, initial_step, attempt)

    @staticmethod
    def chunked(
        func,
        tensor: torch.Tensor,
        initial_step: int,
        *args,
        toma_dimension: Optional[int] = None,
        toma_context=None,
        toma_cache_type: Type[BatchsizeCache] = None,
        toma_policy: Optional[str] = None,
        **kwargs,
    ):
        dimension = toma_dimension or 0

        def body(start: int, end: int):
            return func(tensor.narrow(dimension, start, end - start), start, end, *args, **kwargs)

        explicit.range(
            body,
            0,
            tensor.shape[dimension],
            initial_step,
            toma_context=toma_context or func,
            toma_cache_type=toma_cache_type,
            toma_policy=toma_policy,
        )


class simple:
    """toma's ``simple``: halving, nothing remembered."""

    @staticmethod
    def batch(func, initial_batchsize: int, *args, **kwargs):
        return explicit.batch(
            func, initial_batchsize, *args, toma_cache_type=NoBatchsizeCache, toma_policy="halve", **kwargs
        )

    @staticmethod
    def range(func, start: int, end: int, initial_step: int, *args, **kwargs):
        return explicit.range(
            func, start, end, initial_step, *args, toma_cache_type=NoBatchsizeCache, toma_policy="halve", **kwargs
        )

    @staticmethod
    def chunked(func, tensor, initial_step: int, dimension: int = 0):
        return explicit.chunked(
            func, tensor, initial_step, toma_dimension=dimension, toma_cache_type=NoBatchsizeCache, toma_policy="halve"
        )


class toma:
    """toma's decorators: ``@toma.batch(initial_batchsize=512)``,
    ``@toma.range(initial_step=32)``, ``@toma.chunked(initial_step=512)``, and
    ``toma.execute.*``, which call the decorated function at once."""

    @staticmethod
    def batch(func=None, *, initial_batchsize=None, cache_type=None, context=None, policy=None):
        if func is None:
            return functools.partial(
                toma.batch, initial_batchsize=initial_batchsize, cache_type=cache_type, context=context, policy=policy
            )

        @functools.wraps(func)
        def wrapped(*args, toma_initial_batchsize=None, toma_context=None, **kwargs):
            return explicit.batch(
                func,
                toma_initial_batchsize or initial_batchsize,
                *args,
                toma_cache_type=cache_type,
                toma_context=toma_context or context,
                toma_policy=policy,
                **kwargs,
            )

        return wrapped

    @staticmethod
    def range(func=None, *, initial_step=None, cache_type=None, context=None, policy=None):
        if func is None:
            return functools.partial(
                toma.range, initial_step=initial_step, cache_type=cache_type, context=context, policy=policy
            )

        @functools.wraps(func)
        def wrapped(start: int, end: int, *args, toma_initial_step=None, toma_context=None, **kwargs):
            explicit.range(
                func,
                start,
                end,
                toma_initial_step or initial_step,
                *args,
                toma_cache_type=cache_type,
                toma_context=toma_context or context,
                toma_policy=policy,
                **kwargs,
            )

        return wrapped

    @staticmethod
    def chunked(func=None, *, initial_step=None, dimension=None, cache_type=None, context=None, policy=None):
        if func is None:
            return functools.partial(
                toma.chunked,
                initial_step=initial_step,
                dimension=dimension,
                cache_type=cache_type,
                context=context,
                policy=policy,
            )

        @functools.wraps(func)
        def wrapped(tensor, *args, toma_initial_step=None, toma_dimension=None, toma_context=None, **kwargs):
            explicit.chunked(
                func,
                tensor,
                toma_initial_step or initial_step,
                *args,
                toma_dimension=toma_dimension or dimension,
                toma_cache_type=cache_type,
                toma_context=toma_context or context,
                toma_policy=policy,
                **kwargs,
            )

        return wrapped

    class execute:
        """Call the decorated function at once (toma's ``execute``)."""

        @staticmethod
        def batch(initial_batchsize, cache_type=None, context=None):
            context = context or get_simple_traceback(1)
            return lambda func: explicit.batch(
                func, initial_batchsize, toma_cache_type=cache_type, toma_context=context
            )

        @staticmethod
        def range(start, end, initial_step, cache_type=None, context=None):
            context = context or get_simple_traceback(1)
            return lambda func: explicit.range(
                func, start, end, initial_step, toma_cache_type=cache_type, toma_context=context
            )

        @staticmethod
        def chunked(tensor, initial_step=None, dimension=None, cache_type=None, context=None):
            context = context or get_simple_traceback(1)
            return lambda func: explicit.chunked(
                func, tensor, initial_step, toma_dimension=dimension, toma_cache_type=cache_type, toma_context=context
            )
