"""cycling_utils' ``cycling_utils.sampler``: ``InterruptableDistributedSampler`` (torch's
``DistributedSampler`` order, bit for bit, resumable mid-epoch; cycling_utils' own
keeps epoch 0's order in every epoch), ``InterruptableSampler`` (one process's, for a
dataset sharded already) and their errors, with cycling_utils' current API:
``advance``, ``progress``, ``reset_progress``, ``in_epoch``, ``state_dict`` and
``load_state_dict``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Sized

from torch.utils.data import DistributedSampler

from torchtools import _native
from torchtools.cycling_utils.saving import _world

__all__ = [
    "AdvancedTooFarError",
    "HasNotResetProgressError",
    "InterruptableDistributedSampler",
    "InterruptableSampler",
]


class AdvancedTooFarError(ValueError):
    """More samples marked as consumed (``advance``, or a loaded state's progress) than
    the epoch has for this rank."""


class HasNotResetProgressError(RuntimeError):
    """``set_epoch`` in the middle of an epoch: call ``reset_progress()`` first, or use
    ``with sampler.in_epoch(epoch):``."""


class InterruptableDistributedSampler(DistributedSampler):
    """cycling_utils' sampler: torch's ``DistributedSampler`` (the same indices in the
    same order for every length, rank, seed and epoch) that remembers how far an epoch
    went. Per epoch ``with sampler.in_epoch(epoch):``; :meth:`advance` with each batch's
    size; save :meth:`state_dict` in the checkpoint; after :meth:`load_state_dict` the
    epoch goes on where it stopped. Its length is the epoch's (as cycling_utils' and
    torch's), though a resumed epoch yields only what is left: a ``DataLoader``'s length,
    and the learning-rate schedules and progress bars built on it, stay those of a whole
    epoch. A ``DistributedSampler``, so Lightning and other trainers keep it as it is.
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
        self._has_reset_progress = True

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
        """Sets the epoch (its order), keeping the progress: a state just loaded goes
        on where it stopped. Refused in the middle of an epoch (call
        :meth:`reset_progress` first, or use :meth:`in_epoch`), as cycling_utils does."""
        if not self._has_reset_progress:
            raise HasNotResetProgressError(
                "You must reset progress before setting epoch e.g. `sampler.reset_progress()`\n"
                "or use `with sampler.in_epoch(epoch)` instead of `sampler.set_epoch(epoch)`"
            )
        if epoch != self._inner.epoch:
            progress = self._inner.progress
            self._inner.set_epoch(epoch)
            if progress:
                self._inner.advance(progress)

    def reset_progress(self) -> None:
        """Starts the epoch over: nothing consumed yet."""
        epoch, _, seed, length, replicas, drop_last, shuffle, _ = self._inner.state()
        self._inner.load_state(epoch, 0, seed, length, replicas, drop_last, shuffle, 0, False)
        self._has_reset_progress = True

    @contextmanager
    def in_epoch(self, epoch: int) -> Iterator[None]:
        """``with sampler.in_epoch(epoch):`` around an epoch's loop: sets the epoch (going
        on from a loaded state's progress), and resets the progress when the epoch
        ends (not when it is interrupted by an exception: its state is the one to
        save)."""
        self.set_epoch(epoch)
        yield
        self.reset_progress()

    def advance(self, n: int) -> None:
        """Marks ``n`` more samples as consumed (a batch's size); past the epoch's end
        raises :class:`AdvancedTooFarError` and changes nothing."""
        if self._inner.progress + n > self._inner.num_samples:
            raise AdvancedTooFarError(
                f"You have advanced too far: {self._inner.progress} + {n} samples, but the "
                f"epoch has {self._inner.num_samples} for this rank"
            )
        self._inner.advance(n)
        self._has_reset_progress = False

    @property
    def total_size(self) -> int:
        """Indices in an epoch over all ranks (``DistributedSampler``'s)."""
        return self._inner.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(self._inner.remaining())

    def __len__(self) -> int:
        """Samples in a whole epoch for this rank (a resumed one yields fewer)."""
        return self._inner.num_samples

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
        alone). A progress past the epoch's end raises :class:`AdvancedTooFarError`; a
        state of another world size is refused unless ``reshard=True``, which continues
        its epoch over the new ranks."""
        progress = int(state_dict["progress"])
        same_world = int(state_dict.get("num_replicas", self.num_replicas)) == self.num_replicas
        if same_world and not reshard and progress > self._inner.num_samples:
            raise AdvancedTooFarError(
                f"progress should be less than or equal to the number of samples. "
                f"progress: {progress}, num_samples: {self._inner.num_samples}"
            )
        self._inner.load_state(
            int(state_dict["epoch"]),
            progress,
            int(state_dict.get("seed", self.seed)),
            int(state_dict.get("len", len(self.dataset))),
            int(state_dict.get("num_replicas", self.num_replicas)),
            bool(state_dict.get("drop_last", self.drop_last)),
            bool(state_dict.get("shuffle", self.shuffle)),
            int(state_dict.get("offset", 0)),
            bool(reshard),
        )
        self._has_reset_progress = True


class InterruptableSampler(InterruptableDistributedSampler):
    """cycling_utils' ``InterruptableSampler``: the same, for one process's own dataset
    (a dataset sharded across the ranks already): every sample, shuffled per epoch."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
