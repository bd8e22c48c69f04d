"""Which exception is an out-of-memory: torchtools' one classifier (tt-adaptive's, in
Rust) asked of the message of a ``RuntimeError`` that carries one, as toma checks."""

from __future__ import annotations

from typing import Optional

from torchtools import _native


def oom_kind(exception: BaseException) -> Optional[str]:
    """``"cuda"``, ``"cudnn"``, ``"cublas"``, ``"cpu"`` or ``"mps"`` for an out-of-memory
    ``RuntimeError`` (``torch.OutOfMemoryError`` included), else ``None``."""
    if not (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and isinstance(exception.args[0], str)
    ):
        return None
    return _native.oom_kind(exception.args[0])
