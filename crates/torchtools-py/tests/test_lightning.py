"""torchtools.lightning.EpochHandler with a real Lightning Trainer on the CPU: killed
with SIGKILL at a batch after a save, then resumed with the same command line, each
epoch's samples are torch's DistributedSampler order, each exactly once."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import lightning  # noqa: F401  (the real one: its absence is a failure, not a skip)
import pytest
import torch
from torch.utils.data import DistributedSampler

from torchtools.cycling_utils import InterruptableDistributedSampler
from torchtools.lightning import EpochHandler

N, BATCH, EPOCHS, SEED = 40, 4, 3, 3

# The model records each sample it trained on in its own state, so the checkpoint
# holds exactly what the model learned from: samples trained on after the last save
# are lost with the kill, and must be trained on again, once.
TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from torchtools.cycling_utils import InterruptableDistributedSampler
    from torchtools.lightning import EpochHandler

    ckdir, stop_at, save_freq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = TensorDataset(torch.arange({n}).float().unsqueeze(1), torch.arange({n}))

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.seen = []
            self.restored = 0

        def training_step(self, batch, batch_idx):
            x, i = batch
            if self.global_step == stop_at:
                print("stopping", flush=True)
                time.sleep(600)
            self.seen.append([self.current_epoch, i.tolist()])
            return self.lin(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_save_checkpoint(self, checkpoint):
            checkpoint["seen"] = self.seen

        def on_load_checkpoint(self, checkpoint):
            self.seen = checkpoint["seen"]
            self.restored = len(self.seen)

    sampler = InterruptableDistributedSampler(data, num_replicas=1, rank=0, seed={seed})
    handler = EpochHandler(sampler, ckdir, save_freq=save_freq)
    model = Model()
    trainer = L.Trainer(max_epochs={epochs}, callbacks=[handler], accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size={batch}, sampler=sampler),
                ckpt_path=handler.resume_path())
    print("RESTORED " + str(model.restored), flush=True)
    print("SEEN " + json.dumps(model.seen), flush=True)
    """
).format(n=N, batch=BATCH, epochs=EPOCHS, seed=SEED)


def _expected(epoch):
    theirs = DistributedSampler(list(range(N)), 1, 0, shuffle=True, seed=SEED)
    theirs.set_epoch(epoch)
    return list(theirs)


def _run_until_stopped(script, ckdir, stop_at, save_freq, env):
    child = subprocess.Popen(
        [sys.executable, str(script), str(ckdir), str(stop_at), str(save_freq)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        for line in child.stdout:
            if line.strip() == "stopping":
                break
        else:
            pytest.fail(f"the trainer ended (exit {child.wait()}) before batch {stop_at}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=120)
        child.stdout.close()


# (save every, kill at batch): in the middle of an epoch; right after a save at an
# epoch's last batch; before any save (a fresh start); a save at every batch.
@pytest.mark.parametrize("save_freq,stop_at", [(3, 7), (5, 12), (7, 5), (1, 23)])
def test_a_killed_lightning_trainer_resumes_without_repeating_or_skipping_a_sample(
    tmp_path, clean_env, save_freq, stop_at
):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckdir = tmp_path / "checkpoints"
    _run_until_stopped(script, ckdir, stop_at, save_freq, clean_env)
    saved_before_kill = stop_at >= save_freq
    assert (ckdir / "last.ckpt").is_file() == saved_before_kill
    if ckdir.exists():  # nothing beside the checkpoint (no temporary file left)
        assert os.listdir(ckdir) in ([], ["last.ckpt"])

    done = subprocess.run(
        [sys.executable, str(script), str(ckdir), "-1", str(save_freq)],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.split("SEEN ", 1)[1])
    # The second run resumed from the save (a fresh start with the same seed would see
    # the same order): it trained on only the batches after it, never past the kill.
    restored = int(done.stdout.split("RESTORED ", 1)[1].split()[0])
    if saved_before_kill:
        assert 0 < restored <= stop_at, f"restored {restored} batches, killed at {stop_at}"
    else:
        assert restored == 0
    by_epoch = {}
    for epoch, indices in seen:
        by_epoch.setdefault(epoch, []).extend(indices)
    assert sorted(by_epoch) == list(range(EPOCHS))
    for epoch, indices in by_epoch.items():
        assert indices == _expected(epoch), f"epoch {epoch}"


def test_the_sampler_must_be_the_training_loaders(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8).float().unsqueeze(1))
    handler = EpochHandler(InterruptableDistributedSampler(data, 1, 0), tmp_path, save_freq=2)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_epochs=1, callbacks=[handler], accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(ValueError, match="not the training DataLoader's"):
        trainer.fit(Model(), DataLoader(data, batch_size=2, shuffle=True))


def test_bad_arguments_are_named():
    sampler = InterruptableDistributedSampler(list(range(8)), 1, 0)
    with pytest.raises(ValueError, match="save_freq must be a whole number"):
        EpochHandler(sampler, "ck", save_freq=-1)
    with pytest.raises(ValueError, match="save_freq"):
        EpochHandler(sampler, "ck", save_freq=2.5)
    with pytest.raises(TypeError, match="InterruptableDistributedSampler"):
        EpochHandler(DistributedSampler(list(range(8)), 1, 0), "ck", save_freq=1)
