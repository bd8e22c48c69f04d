"""``python -m torchtools.launch``: ``torch.distributed.launch``'s command line, run by
``torchtools launch`` (installed beside this Python by the same wheel).

Replace ``torch.distributed.launch`` by ``torchtools.launch`` in a launch line, e.g.
torchhandy's::

    python3 -m torchtools.launch --nproc_per_node=2 --master_port="29501" --use_env main.py --synch

As ``torch.distributed.launch`` did, each rank gets ``--local-rank=N`` after the script
unless ``--use_env`` (or ``--use-env``) is given; ``LOCAL_RANK``, ``RANK`` and
``WORLD_SIZE`` are always set, as under torchrun. The same deprecation warning is given:
prefer ``torchtools launch`` (torchrun's command line) and ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import List, Optional

__all__ = ["main"]

DEPRECATION = (
    "The module torch.distributed.launch is deprecated\n"
    "and will be removed in future. Use torchrun (here: `torchtools launch`).\n"
    "Note that --use-env is set by default in torchrun.\n"
    "If your script expects `--local-rank` argument to be set, please\n"
    "change it to read from `os.environ['LOCAL_RANK']` instead. See \n"
    "https://pytorch.org/docs/stable/distributed.html#launch-utility for \n"
    "further instructions\n"
)


def _command() -> str:
    """The ``torchtools`` command the wheel installed beside this Python."""
    path = os.path.join(os.path.dirname(sys.executable), "torchtools")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"no torchtools command beside {sys.executable}: install the torchtools-cli "
            "wheel into this environment (pip install torchtools-cli)"
        )
    return path


def _uses_env(argv: List[str]) -> bool:
    """Whether ``--use_env``/``--use-env`` is among the launcher's own options (before
    the script or ``--``; the script's own arguments are not looked at)."""
    for arg in argv:
        if arg in ("--use_env", "--use-env"):
            return True
        if arg == "--" or arg.endswith(".py"):
            return False
    return False


def main(argv: Optional[List[str]] = None) -> None:
    """Runs ``torchtools launch`` with ``argv`` (default: this process's arguments) in
    place of this process."""
    args = list(sys.argv[1:] if argv is None else argv)
    warnings.warn(DEPRECATION, FutureWarning, stacklevel=2)
    command = _command()
    extra = [] if _uses_env(args) else ["--local-rank-arg"]
    sys.stderr.flush()
    os.execv(command, [command, "launch", *extra, *args])


if __name__ == "__main__":
    main()
