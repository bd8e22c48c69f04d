"""torchtools for Python: the Python torchtools' API (device choice, cooperative GPU
reservation with a lock, a fair queue and a memory fence, probes), cycling_utils'
(``torchtools.cycling_utils``, and its Lightning callback in ``torchtools.lightning``), toma's (``torchtools.toma``) and torchhandy's
(``torchtools.torchhandy``, launched by ``python -m torchtools.launch``), backed by the
Rust crates of torchtools.

A reservation taken here is in the same queue, ``torchtools locks``, ``top`` and
``usage`` as the ``torchtools`` command's (installed by the same wheel).
"""

from torchtools._native import (
    BadRequestError,
    FenceError,
    GpuBusyError,
    TorchtoolsError,
    __version__,
)
from torchtools.device import get_device_from_env
from torchtools.gpu_lock import GpuReservation, reserve_gpu_for_training
from torchtools.gpu_scheduler import (
    estimate_gpu_usage_by_probe,
    make_probe_fn,
    run_training_with_reservation,
)

__all__ = [
    "__version__",
    "BadRequestError",
    "FenceError",
    "GpuBusyError",
    "GpuReservation",
    "TorchtoolsError",
    "estimate_gpu_usage_by_probe",
    "get_device_from_env",
    "make_probe_fn",
    "reserve_gpu_for_training",
    "run_training_with_reservation",
]
