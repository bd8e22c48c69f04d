"""cycling_utils' ``cycling_utils.saving``: ``atomic_torch_save`` (durable and atomic)
and ``AtomicDirectory``."""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from torchtools import _native

__all__ = ["atomic_torch_save", "AtomicDirectory"]


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


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicDirectory:
    """cycling_utils' ``AtomicDirectory``: each checkpoint in a new directory
    (``CHK0``, ``CHK1``...), then a symlink (``latest_pt``) switched to it atomically, so
    a crash mid-save leaves the previous checkpoint the latest. Only the writing rank
    (rank 0, or ``is_master``) creates and switches; the others get ``None``.

    Beyond cycling_utils: the new directory's files and the directory itself are
    flushed to the disk before the switch, and the symlink's directory after it, so the
    latest checkpoint survives a power cut too; the symlink is made in
    ``output_directory`` (not the working directory).
    """

    def __init__(
        self,
        output_directory: "str | os.PathLike[str]",
        symlink_name: str = "latest_pt",
        chk_dir_prefix: str = "CHK",
        cleanup: bool = True,
        is_master: Optional[bool] = None,
    ) -> None:
        self.output_directory = os.fspath(output_directory)
        self.symlink_name = symlink_name
        self.chk_dir_prefix = chk_dir_prefix
        self.cleanup = cleanup
        if is_master is None:
            _, rank = _world(None, None)
            is_master = rank == 0
        self.is_master = is_master

    @property
    def latest(self) -> Optional[str]:
        """The latest checkpoint directory, if there is one."""
        link = os.path.join(self.output_directory, self.symlink_name)
        if not os.path.islink(link):
            return None
        return os.path.join(self.output_directory, os.readlink(link))

    def _index(self, name: str) -> Optional[int]:
        rest = name[len(self.chk_dir_prefix) :]
        return int(rest) if name.startswith(self.chk_dir_prefix) and rest.isdigit() else None

    def prepare_checkpoint_directory(self) -> Optional[str]:
        """A new, empty directory for the next checkpoint (the writing rank only);
        with ``cleanup``, the checkpoints older than the latest are removed first."""
        if not self.is_master:
            return None
        os.makedirs(self.output_directory, exist_ok=True)
        latest = self.latest
        latest_name = os.path.basename(latest) if latest else None
        found = {}
        for name in os.listdir(self.output_directory):
            index = self._index(name)
            if index is not None and os.path.isdir(os.path.join(self.output_directory, name)):
                found[name] = index
        latest_index = found.get(latest_name, -1) if latest_name else -1
        for name, index in found.items():
            # Never the latest; with cleanup every other, else those a crash left
            # behind after it (never switched to).
            if name != latest_name and (self.cleanup or index > latest_index):
                shutil.rmtree(os.path.join(self.output_directory, name))
        path = os.path.join(self.output_directory, f"{self.chk_dir_prefix}{latest_index + 1}")
        os.mkdir(path)
        return path

    def atomic_symlink(self, checkpoint_directory: "str | os.PathLike[str]") -> None:
        """Makes ``checkpoint_directory`` the latest: its files flushed to the disk,
        then the symlink replaced in one rename."""
        if not self.is_master:
            return
        checkpoint_directory = os.fspath(checkpoint_directory)
        for root, _dirs, files in os.walk(checkpoint_directory):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
        link = os.path.join(self.output_directory, self.symlink_name)
        temp = f"{link}.{os.getpid()}.tmp"
        if os.path.lexists(temp):
            os.remove(temp)
        os.symlink(os.path.basename(checkpoint_directory), temp)
        os.replace(temp, link)
        _fsync(self.output_directory)


def _world(num_replicas: Optional[int], rank: Optional[int]) -> "tuple[int, int]":
    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        else:
            num_replicas = int(os.environ.get("WORLD_SIZE", "1")) if num_replicas is None else num_replicas
            rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return num_replicas, rank
