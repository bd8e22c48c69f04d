"""Lightning's side of cycling_utils: :class:`EpochHandler`, the callback cycling_utils'
``EpochHandler`` meant to be, so a Lightning ``Trainer`` killed at any moment resumes
its epoch where it stopped, without repeating or skipping a sample.

.. code-block:: python

    import lightning as L
    from torch.utils.data import DataLoader
    from torchtools.cycling_utils import InterruptableDistributedSampler
    from torchtools.lightning import EpochHandler

    sampler = InterruptableDistributedSampler(dataset)
    handler = EpochHandler(sampler, "checkpoints", save_freq=100)
    trainer = L.Trainer(max_epochs=10, callbacks=[handler])
    trainer.fit(model, DataLoader(dataset, batch_size=32, sampler=sampler),
                ckpt_path=handler.resume_path())   # None the first time

Needs ``lightning`` (or the older ``pytorch_lightning``), which torchtools does not
install for you.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Optional

from torchtools import _native
from torchtools.cycling_utils.sampler import InterruptableDistributedSampler

try:  # the unified package first, as Lightning's own docs use it
    import lightning.pytorch as _pl
except ImportError:  # pragma: no cover - only where just pytorch_lightning is installed
    try:
        import pytorch_lightning as _pl  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError(
            "torchtools.lightning needs Lightning: `pip install lightning` "
            "(or `pytorch_lightning`)"
        ) from e

# Lightning's own rule for a batch's size, from whichever package was imported.
_extract_batch_size = importlib.import_module(_pl.__name__ + ".utilities.data").extract_batch_size

__all__ = ["EpochHandler"]

_LAST = "last.ckpt"


class EpochHandler(_pl.Callback):
    """cycling_utils' ``EpochHandler(sampler, checkpoint_dir, save_freq)``, done as it
    meant: after each training batch the sampler advances by the batch's number of
    samples, at each epoch's end its progress starts over, and every ``save_freq``
    batches the whole training state (model, optimizer, loops **and** the sampler's
    place) is saved atomically and durably to ``checkpoint_dir/last.ckpt``.

    Where cycling_utils' is wrong, this one is right:

    - it advanced by ``len(batch)``: 2 for an ``(inputs, targets)`` batch, whatever the
      batch size; here the samples are counted (Lightning's own rule: the first
      tensor's first dimension), or given by ``batch_size=``;
    - it saved the sampler alone (``sampler_last.pt``), out of step with the model; here
      the sampler's state travels in every Lightning checkpoint (this callback's state,
      ModelCheckpoint's files included), so ``ckpt_path=`` resumes both together;
    - its save was rank 0's alone, in the middle of a collective save; here every rank
      takes part in Lightning's ``save_checkpoint`` and rank 0 makes the file durable
      and renames it into place (a ``kill -9`` mid-save leaves the previous one whole).

    The sampler must be the training dataloader's (``DataLoader(..., sampler=sampler)``);
    a ``Trainer`` that replaced it (``use_distributed_sampler=True`` with another
    sampler class) is refused at the start of training. ``save_freq=0`` saves nothing
    itself (the sampler's state is still in your own checkpoints).
    """

    def __init__(
        self,
        sampler: InterruptableDistributedSampler,
        checkpoint_dir: "str | os.PathLike[str]",
        save_freq: int,
        batch_size: Optional[Any] = None,
    ) -> None:
        super().__init__()
        if not isinstance(sampler, InterruptableDistributedSampler):
            raise TypeError(
                "EpochHandler's sampler must be torchtools.cycling_utils' "
                f"InterruptableDistributedSampler or InterruptableSampler, not {type(sampler).__name__}"
            )
        if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 0:
            raise ValueError(
                f"EpochHandler's save_freq must be a whole number of batches >= 0 (0: never), not {save_freq!r}"
            )
        if batch_size is not None and not callable(batch_size):
            raise TypeError("EpochHandler's batch_size must be a function of the batch (or None: counted)")
        self.sampler = sampler
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.save_freq = save_freq
        self._batch_size = batch_size
        self._batches = 0

    @property
    def last_checkpoint(self) -> str:
        """Where the atomic checkpoint goes: ``checkpoint_dir/last.ckpt``."""
        return os.path.join(self.checkpoint_dir, _LAST)

    def resume_path(self) -> Optional[str]:
        """:attr:`last_checkpoint` if it exists, else ``None``: pass it as ``ckpt_path``
        to ``Trainer.fit``, the same line the first time and after a kill."""
        return self.last_checkpoint if os.path.isfile(self.last_checkpoint) else None

    # -- Lightning's hooks ------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loaders = trainer.train_dataloader
        flat = loaders.values() if isinstance(loaders, dict) else (
            loaders if isinstance(loaders, (list, tuple)) else [loaders]
        )
        for loader in flat:
            found = getattr(loader, "sampler", None)
            batch_sampler = getattr(loader, "batch_sampler", None)
            if found is self.sampler or getattr(batch_sampler, "sampler", None) is self.sampler:
                return
        raise ValueError(
            "EpochHandler's sampler is not the training DataLoader's: pass it as "
            "DataLoader(dataset, sampler=sampler, ...), and with several processes give the "
            "Trainer use_distributed_sampler=False if it replaced it"
        )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.sampler.advance(self._count(batch))
        self._batches += 1
        if self.save_freq and self._batches % self.save_freq == 0:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.sampler.reset_progress()

    def state_dict(self) -> Dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "batches": self._batches}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict["sampler"])
        self._batches = int(state_dict.get("batches", 0))
        if self.sampler.progress >= self.sampler.num_samples:
            # Saved after an epoch's last batch: Lightning counts that epoch done and
            # goes on with the next, which must start at its first sample (the
            # sampler would carry the finished epoch's progress into it: an empty epoch).
            self.sampler.reset_progress()

    # -- saving -----------------------------------------------------------------------

    def save(self, trainer: Any) -> None:
        """Saves the whole training state to :attr:`last_checkpoint`, atomically and
        durably (every rank calls this together, as Lightning's ``save_checkpoint``)."""
        writer = _writer(self.last_checkpoint, trainer.is_global_zero)
        temp = writer.temp_path if writer is not None else self.last_checkpoint + ".unused"
        try:
            trainer.save_checkpoint(temp)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.commit()

    def _count(self, batch: Any) -> int:
        if self._batch_size is not None:
            return int(self._batch_size(batch))
        return int(_extract_batch_size(batch))


def _writer(path: str, is_global_zero: bool) -> Optional["_native.AtomicWriter"]:
    if not is_global_zero:
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return _native.AtomicWriter(path)

