"""torchhandy's ``Parallel_Trainer``: the same training code on one device or on many
processes with PyTorch's own DistributedDataParallel. A drop-in for torchhandy 0.1.8's
``from torchhandy.Parallel import Parallel_Trainer``::

    from torchtools.torchhandy import Parallel_Trainer

    trainer = Parallel_Trainer(synch, config)      # config.device, config.n_gpus
    model = trainer.model_parallel(model)
    sampler = trainer.dataset_parallel(dataset)
    for epoch in range(epochs):
        for x, y in trainer.get_loader(dataset, epoch, bsz, 0, sampler):
            ...
        trainer.save_model({"epoch": epoch}, model, "model.pt")

launched with ``torchtools launch --nproc-per-node 2 main.py --synch`` (or torchhandy's
own line, ``python3 -m torchtools.launch --nproc_per_node=2 --master_port="29501"
--use_env main.py --synch``, or torchrun), and ``python3 main.py`` for one device.

Where torchhandy is wrong, this is right (each method says where):

- the rank is ``RANK`` and the world size ``WORLD_SIZE``, as the launcher sets them
  (torchhandy took the rank from ``LOCAL_RANK``, wrong past one node, and the world
  size from ``config.n_gpus``, which hangs when they differ);
- the process group is NCCL on a GPU of its own, Gloo where there is none (torchhandy
  needed a GPU per process);
- ``save_model`` writes atomically and durably, and reads the file back before it
  returns (torchhandy's ``torch.save`` left a cut file after a crash);
- the sampler is cycling_utils' resumable one (torch's ``DistributedSampler`` order, bit
  for bit): call ``advance(len(batch))`` per batch and save its ``state_dict()`` to go
  on mid-epoch after a restart.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from torchtools.cycling_utils import InterruptableDistributedSampler, atomic_torch_save

__all__ = ["Parallel_Trainer"]


def _variable(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"{name} is not set: with synch=True, start the script through a launcher "
            "(`torchtools launch --nproc-per-node N main.py --synch`, torchrun, or "
            "`python3 -m torchtools.launch --use_env ...`), or pass synch=False"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer (a launcher sets it)") from None


class Parallel_Trainer(object):
    """torchhandy's ``Parallel_Trainer(synch, config)``: ``synch=True`` trains with DDP
    over the processes the launcher started, ``False`` on ``config.device`` alone."""

    def __init__(self, synch: bool, config: Any) -> None:
        self.synch = bool(synch)
        self.config = config
        if not self.synch:
            self.device = config.device
            self.rank = 0
            self.local_rank = 0
            self.world_size = 1
            return
        # The launcher's variables, not LOCAL_RANK and config.n_gpus (see the module).
        self.rank = _variable("RANK")
        self.local_rank = _variable("LOCAL_RANK")
        self.world_size = _variable("WORLD_SIZE")
        n_gpus = getattr(config, "n_gpus", None)
        if n_gpus is not None and n_gpus != self.world_size:
            warnings.warn(
                f"config.n_gpus is {n_gpus} but the launcher started {self.world_size} "
                "process(es): using the launcher's (torchhandy would have hung)",
                stacklevel=2,
            )
        own_gpu = torch.cuda.is_available() and self.local_rank < torch.cuda.device_count()
        if own_gpu:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if own_gpu else "gloo",
                rank=self.rank,
                world_size=self.world_size,
                init_method="env://",
            )

    def get_device(self) -> Any:
        """The device this process trains on: ``cuda:LOCAL_RANK`` (the CPU without a
        GPU) with ``synch``, else ``config.device``."""
        return self.device

    def model_parallel(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this process's device, in training mode; with ``synch``, in
        ``DistributedDataParallel`` (batch norms synchronised across processes on
        GPUs, where PyTorch's ``SyncBatchNorm`` runs)."""
        model = model.to(self.device)
        model.train()
        if not self.synch:
            return model
        on_gpu = torch.device(self.device).type == "cuda"
        if on_gpu:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return DistributedDataParallel(
            model,
            device_ids=[self.local_rank] if on_gpu else None,
            find_unused_parameters=True,
        )

    def dataset_parallel(self, dataset: Dataset) -> Optional[InterruptableDistributedSampler]:
        """With ``synch``, the sampler that gives this process its share of ``dataset``
        (torch's ``DistributedSampler`` order, resumable mid-epoch); else ``None``."""
        if not self.synch:
            return None
        return InterruptableDistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank)

    def get_loader(
        self,
        dataset: Dataset,
        epoch: int,
        bsz: int,
        num_workers: int,
        train_sampler: Optional[InterruptableDistributedSampler] = None,
    ) -> DataLoader:
        """The loader of ``epoch``: with ``synch``, batches of ``bsz`` from this
        process's share (``train_sampler``, made here when not given); else shuffled
        batches of the whole dataset. A sampler resumed mid-epoch goes on from where it
        stopped (the epoch is restarted only when it is another one)."""
        if not self.synch:
            return DataLoader(dataset, bsz, num_workers=num_workers, shuffle=True, drop_last=False)
        if train_sampler is None:
            train_sampler = self.dataset_parallel(dataset)
        if getattr(train_sampler, "epoch", None) != epoch:
            # Another epoch: the last one is over.
            if hasattr(train_sampler, "reset_progress"):
                train_sampler.reset_progress()
            train_sampler.set_epoch(epoch)
        return DataLoader(
            dataset,
            bsz,
            pin_memory=torch.device(self.device).type == "cuda",
            num_workers=num_workers,
            sampler=train_sampler,
        )

    def save_model(self, ckpt: dict, model: torch.nn.Module, path: "str | os.PathLike[str]") -> None:
        """Puts the model's state dict (unwrapped from DDP) in ``ckpt["state_dict"]``
        and saves ``ckpt`` to ``path`` from rank 0 only: atomically and durably (a crash
        leaves the old file or the new one), read back before it returns."""
        if self.rank != 0:
            return
        ckpt["state_dict"] = self.get_model(model).state_dict()
        atomic_torch_save(ckpt, path)
        torch.load(path, map_location="cpu", weights_only=False)

    def write_log(self, log_file: Any, content: str) -> None:
        """Writes ``content`` and a newline to ``log_file`` from rank 0 only, flushed."""
        if self.rank == 0:
            log_file.write(content + "\n")
            log_file.flush()

    def call_func(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``func(*args, **kwargs)`` on rank 0 only, and returns what it returned
        there (``None`` on the other ranks)."""
        if self.rank == 0:
            return func(*args, **kwargs)
        return None

    def get_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside ``DistributedDataParallel`` (the model itself without
        ``synch``)."""
        return model.module if isinstance(model, DistributedDataParallel) else model
