"""cycling_utils' API, backed by torchtools: ``atomic_torch_save`` (durable and atomic),
``AtomicDirectory``, ``InterruptableDistributedSampler`` (torch's ``DistributedSampler``
order, bit for bit, resumable mid-epoch) and ``InterruptableSampler``. A drop-in:
``from torchtools.cycling_utils import ...``, and its modules
(``torchtools.cycling_utils.sampler``, ``.saving``) for its submodule imports."""

from torchtools.cycling_utils import sampler, saving
from torchtools.cycling_utils.sampler import (
    AdvancedTooFarError,
    HasNotResetProgressError,
    InterruptableDistributedSampler,
    InterruptableSampler,
)
from torchtools.cycling_utils.saving import AtomicDirectory, atomic_torch_save

__all__ = [
    "AdvancedTooFarError",
    "AtomicDirectory",
    "HasNotResetProgressError",
    "InterruptableDistributedSampler",
    "InterruptableSampler",
    "atomic_torch_save",
    "sampler",
    "saving",
]
