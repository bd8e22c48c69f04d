"""cycling_utils' API, backed by torchtools: ``atomic_torch_save`` (durable and atomic)
and ``InterruptableDistributedSampler`` (torch's ``DistributedSampler`` order, bit for
bit, resumable mid-epoch). A drop-in: ``from torchtools.cycling_utils import ...``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, Optional, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from torchtools import _native

__all__ = ["atomic_torch_save", "InterruptableDistributedSampler"]


def atomic_torch_save(obj: Any, f: "str | os.PathLike[str]", **kwargs: Any) -> None:
    """``torch.save(obj, f)``, atomically and durably: written beside ``f``, flushed to
    the disk, then renamed over it. A crash or ``kill -9`` at any moment leaves ``f``
    as it was or as it is now, never cut short; ``torch.load`` reads it as usual."""
    writer = _native.AtomicWriter(os.fspath(f))
    try:
        with open(writer.temp_path, "wb") as out:
            torch.save(obj, out, **kwargs)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _world(num_replicas: Optional[int], rank: Optional[int]) -> "tuple[int, int]":
    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            num_replicas = int(os.environ.get("WORLD_SIZE", "1")) if num_replicas is None else num_replicas
            rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return num_replicas, rank


class InterruptableDistributedSampler(Sampler[int]):
    """cycling_utils' sampler: torch's ``DistributedSampler`` (the same indices in the
    same order for every length, rank, seed and epoch) that remembers how far an epoch
    went. Call :meth:`advance` with each batch's size; save :meth:`state_dict` in the
    checkpoint; after :meth:`load_state_dict` the epoch goes on where it stopped.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = _world(num_replicas, rank)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._inner = _native.Sampler(len(dataset), num_replicas, rank, shuffle, seed, drop_last)

    @property
    def epoch(self) -> int:
        return self._inner.epoch

    @property
    def progress(self) -> int:
        """Samples of this epoch this rank has consumed."""
        return self._inner.progress

    @property
    def num_samples(self) -> int:
        return self._inner.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its beginning."""
        self._inner.set_epoch(epoch)

    def advance(self, n: int) -> None:
        """Marks ``n`` more samples as consumed (a batch's size)."""
        self._inner.advance(n)

    def __iter__(self) -> Iterator[int]:
        return iter(self._inner.remaining())

    def __len__(self) -> int:
        return self._inner.num_samples - self._inner.progress

    def state_dict(self) -> Dict[str, Any]:
        """``{"epoch", "progress"}`` as cycling_utils saves them, and what they mean
        (seed, length, replicas...), so a resume into another dataset is refused."""
        epoch, progress, seed, length, replicas, drop_last, shuffle, offset = self._inner.state()
        return {
            "epoch": epoch,
            "progress": progress,
            "seed": seed,
            "len": length,
            "num_replicas": replicas,
            "drop_last": drop_last,
            "shuffle": shuffle,
            "offset": offset,
        }

    def load_state_dict(self, state_dict: Dict[str, Any], reshard: bool = False) -> None:
        """Resumes from :meth:`state_dict` (or cycling_utils' ``{"epoch", "progress"}``
        alone). A state of another world size is refused unless ``reshard=True``, which
        continues its epoch over the new ranks."""
        self._inner.load_state(
            int(state_dict["epoch"]),
            int(state_dict["progress"]),
            int(state_dict.get("seed", self.seed)),
            int(state_dict.get("len", len(self.dataset))),
            int(state_dict.get("num_replicas", self.num_replicas)),
            bool(state_dict.get("drop_last", self.drop_last)),
            bool(state_dict.get("shuffle", self.shuffle)),
            int(state_dict.get("offset", 0)),
            bool(reshard),
        )
