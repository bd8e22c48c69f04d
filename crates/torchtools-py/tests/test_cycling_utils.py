"""cycling_utils' API: the sampler's order is torch's DistributedSampler's, resumed
mid-epoch exactly; atomic_torch_save writes what torch.load reads, and a kill -9 in
the middle of a save leaves the previous file whole."""

import itertools
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from torchtools import BadRequestError
from torchtools.cycling_utils import InterruptableDistributedSampler, atomic_torch_save


@pytest.mark.parametrize("length", [1, 2, 7, 64, 1001])
def test_the_order_is_torchs_for_every_rank_seed_and_epoch(length):
    data = list(range(length))
    for replicas, shuffle, drop_last, seed in itertools.product(
        [1, 2, 3, 8], [True, False], [True, False], [0, 42]
    ):
        for rank in range(replicas):
            ours = InterruptableDistributedSampler(data, replicas, rank, shuffle, seed, drop_last)
            theirs = DistributedSampler(data, replicas, rank, shuffle, seed, drop_last)
            for epoch in (0, 1, 7):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (replicas, rank, shuffle, drop_last, seed, epoch)
                assert len(ours) == len(theirs)


def test_a_resumed_epoch_goes_on_where_it_stopped():
    data = list(range(997))
    theirs = DistributedSampler(data, 4, 3, seed=9)
    theirs.set_epoch(5)
    expected = list(theirs)
    for done in (0, 1, 100, len(expected) - 1, len(expected)):
        before = InterruptableDistributedSampler(data, 4, 3, seed=9)
        before.set_epoch(5)
        before.advance(done)
        state = before.state_dict()
        assert (state["epoch"], state["progress"]) == (5, done)
        after = InterruptableDistributedSampler(data, 4, 3, seed=9)
        after.load_state_dict(state)
        assert list(after) == expected[done:]
        # The length stays the whole epoch's, as cycling_utils' and torch's: a
        # DataLoader's length (and Lightning's count of an epoch's batches) with it.
        assert len(after) == len(expected)
        assert isinstance(after, DistributedSampler)
    # cycling_utils' own state ({epoch, progress}) resumes too.
    after = InterruptableDistributedSampler(data, 4, 3, seed=9)
    after.load_state_dict({"epoch": 5, "progress": 10})
    assert list(after) == expected[10:]


def test_a_state_of_another_dataset_or_world_is_refused():
    state = InterruptableDistributedSampler(list(range(100)), 2, 0).state_dict()
    with pytest.raises(BadRequestError):
        InterruptableDistributedSampler(list(range(50)), 2, 0).load_state_dict(state)
    with pytest.raises(BadRequestError):
        InterruptableDistributedSampler(list(range(100)), 4, 0).load_state_dict(state)
    # ...unless resharding is asked for: the epoch goes on over the new ranks.
    InterruptableDistributedSampler(list(range(100)), 4, 0).load_state_dict(state, reshard=True)


def test_cycling_utils_current_api_in_epoch_progress_and_its_errors():
    from torchtools.cycling_utils.sampler import (
        AdvancedTooFarError,
        HasNotResetProgressError,
        InterruptableDistributedSampler as Sampler,
    )

    data = list(range(10))
    sampler = Sampler(data, 1, 0, shuffle=False)
    with pytest.raises(AdvancedTooFarError):
        sampler.advance(11)
    assert sampler.progress == 0  # nothing changed
    with sampler.in_epoch(0):
        sampler.advance(4)
        # In the middle of an epoch, another one is refused.
        with pytest.raises(HasNotResetProgressError):
            sampler.set_epoch(1)
        assert sampler.state_dict()["progress"] == 4
    assert sampler.progress == 0 and sampler.epoch == 0  # reset when the epoch ended
    # An interrupted epoch keeps its progress, and a loaded state goes on in in_epoch.
    with pytest.raises(KeyError):
        with sampler.in_epoch(3):
            sampler.advance(6)
            raise KeyError("interrupted")
    state = sampler.state_dict()
    resumed = Sampler(data, 1, 0, shuffle=False)
    resumed.load_state_dict({"epoch": state["epoch"], "progress": state["progress"]})
    with resumed.in_epoch(3):
        assert list(resumed) == [6, 7, 8, 9]
    with pytest.raises(AdvancedTooFarError):
        Sampler(data, 1, 0).load_state_dict({"epoch": 0, "progress": 11})
    with pytest.raises(ValueError):  # AdvancedTooFarError is a ValueError
        Sampler(data, 1, 0).advance(11)


def test_it_drives_a_dataloader():
    sampler = InterruptableDistributedSampler(list(range(10)), 1, 0, shuffle=False)
    sampler.advance(4)
    batches = [b.tolist() for b in DataLoader(list(range(10)), batch_size=3, sampler=sampler)]
    assert batches == [[4, 5, 6], [7, 8, 9]]


def test_atomic_torch_save_is_read_by_torch_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "step": 7}
    atomic_torch_save(state, path)
    loaded = torch.load(path)
    assert loaded["step"] == 7
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    # A file object is refused by its own error, and nothing is left behind.
    with pytest.raises(TypeError):
        atomic_torch_save(state, open(tmp_path / "f", "wb"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "f"]


def test_kill_9_during_a_save_leaves_the_previous_file_whole(tmp_path, clean_env):
    path = tmp_path / "latest.pt"
    # The second save stops half written (its bytes flushed to the temporary file) and
    # says so: the kill lands inside it, not between two saves.
    saver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import io, time
                import torch
                from torchtools.cycling_utils import atomic_torch_save
                big = torch.zeros(64 * 1024 * 1024 // 4)
                big[0] = 1
                atomic_torch_save({{"n": 1, "big": big}}, {str(path)!r})
                print("saved 1", flush=True)
                whole_save = torch.save
                def half_then_wait(obj, f, **kwargs):
                    buf = io.BytesIO()
                    whole_save(obj, buf, **kwargs)
                    data = buf.getvalue()
                    f.write(data[: len(data) // 2])
                    f.flush()
                    print("mid-save", flush=True)
                    time.sleep(600)
                torch.save = half_then_wait
                big[0] = 2
                atomic_torch_save({{"n": 2, "big": big}}, {str(path)!r})
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env,
    )
    assert saver.stdout.readline() == "saved 1\n"
    assert saver.stdout.readline() == "mid-save\n"
    # Half of the second save is on the disk, beside the first.
    written = [p for p in tmp_path.iterdir() if p != path]
    assert written and all(p.stat().st_size > 0 for p in written), written
    saver.send_signal(signal.SIGKILL)
    saver.wait(timeout=120)
    loaded = torch.load(path)
    assert loaded["n"] == 1 and loaded["big"][0].item() == 1
    assert loaded["big"].numel() == 64 * 1024 * 1024 // 4
