"""toma's ``toma.stacktrace``: a call stack that can be hashed (a cache key: the same
call site gives the same key), cut at a watermark. Read from the frames (file, line,
function), not with ``inspect.stack()``, which reads source files at every call."""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Tuple

__all__ = ["get_simple_traceback", "watermark", "set_watermark"]

#: The depth of the outermost frame a traceback keeps (0: all of them).
_watermark = 0


def _depth(frame: Any) -> int:
    depth = 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def get_simple_traceback(ignore_top: int = 0) -> Tuple[Tuple[str, int, str], ...]:
    """The caller's stack, innermost first, without its ``ignore_top`` innermost frames
    and without the frames outside the watermark: ``(file, line, function)`` each."""
    frame = sys._getframe(1 + ignore_top)
    depth = _depth(frame)
    stack = []
    while frame is not None and depth >= max(_watermark, 1):
        code = frame.f_code
        stack.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
        depth -= 1
    return tuple(stack)


@contextmanager
def watermark() -> Iterator[None]:
    """Within the block, tracebacks stop at the frame that runs the ``with``."""
    global _watermark
    old = _watermark
    # This generator's frame, `__enter__`'s, then the `with` block's.
    _watermark = _depth(sys._getframe(2))
    try:
        yield
    finally:
        _watermark = old


def set_watermark(func: Callable[..., Any]) -> Callable[..., Any]:
    """Tracebacks taken within ``func`` stop at ``func``'s frame."""

    @functools.wraps(func)
    def watermark_wrapper(*args: Any, **kwargs: Any) -> Any:
        global _watermark
        old = _watermark
        # `func`'s frame will be one below this one.
        _watermark = _depth(sys._getframe(0)) + 1
        try:
            return func(*args, **kwargs)
        finally:
            _watermark = old

    return watermark_wrapper
