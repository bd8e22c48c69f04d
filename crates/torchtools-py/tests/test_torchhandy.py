"""torchhandy's Parallel_Trainer and its launch line: the README's own fragments, run
with only the import (and the launcher's module) changed, under `python -m
torchtools.launch`, `torchtools launch` and torchrun; two ranks train as one process on
the whole batch."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

MAIN = """
import argparse, sys
import torch
from torchtools.torchhandy import Parallel_Trainer

class Config(object):
    n_gpus = 2
    device = 'cpu'

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description = 'yourdescription')
    parser.add_argument('--synch', '-s', action = 'store_true')
    args, unknown = parser.parse_known_args()
    synch = args.synch
    config = Config()
    trainer = Parallel_Trainer(synch, config)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = trainer.model_parallel(torch.nn.Linear(4, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = trainer.dataset_parallel(dataset)
    with open(sys.argv[-1], "a") as log:
        for epoch in range(2):
            for xb, yb in trainer.get_loader(dataset, epoch, 4, 0, sampler):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
            trainer.write_log(log, f"epoch {epoch} done")
    trainer.save_model({"epoch": 2}, model, sys.argv[-2])
    params = torch.cat([p.detach().flatten() for p in trainer.get_model(model).parameters()])
    trainer.call_func(print, "params", params.tolist())
"""

REFERENCE = """
import torch
from torch.utils.data import DistributedSampler
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(32, 4, generator=g, dtype=torch.float64)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Linear(4, 1).double()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
# One process, the whole batch: both ranks' batches of each step together.
sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for xb, yb in torch.utils.data.DataLoader(dataset, 8, sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
print("params", torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_of(out):
    line = [l for l in out.splitlines() if "params [" in l]
    assert len(line) == 1, out  # printed by rank 0 only
    return torch.tensor(eval(line[0].split("params ", 1)[1]), dtype=torch.float64)


@pytest.mark.parametrize("launcher", ["torchtools.launch", "torchtools launch", "torchrun"])
def test_two_ranks_train_as_one_process_on_the_whole_batch(launcher, command, clean_env, lock_dir, tmp_path):
    main = tmp_path / "main.py"
    main.write_text(MAIN)
    saved, log = tmp_path / "model.pt", tmp_path / "train.log"
    port = str(free_port())
    line = {
        # torchhandy's own line, with torchtools.launch for torch.distributed.launch.
        "torchtools.launch": [sys.executable, "-m", "torchtools.launch", "--nproc_per_node=2",
                              f"--master_port={port}", "--use_env"],
        "torchtools launch": [command, "launch", "--nproc-per-node", "2", "--master-port", port],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                     f"--master_port={port}"],
    }[launcher]
    out = subprocess.run(line + [str(main), "--synch", str(saved), str(log)],
                         capture_output=True, text=True, env=clean_env, timeout=600)
    assert out.returncode == 0, out.stderr
    ref = subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True, text=True,
                         env=clean_env, check=True)
    assert torch.allclose(params_of(out.stdout), params_of(ref.stdout), rtol=0, atol=1e-12)
    # Rank 0 alone wrote the log and the checkpoint, which loads.
    assert log.read_text() == "epoch 0 done\nepoch 1 done\n"
    ckpt = torch.load(saved, weights_only=False)
    assert ckpt["epoch"] == 2 and set(ckpt["state_dict"]) == {"weight", "bias"}


def test_without_use_env_each_rank_gets_local_rank_and_the_deprecation_word(clean_env, lock_dir, tmp_path):
    script = tmp_path / "legacy.py"
    script.write_text(textwrap.dedent("""
        import argparse, os
        p = argparse.ArgumentParser()
        p.add_argument("--local-rank", "--local_rank", type=int)
        p.add_argument("--synch", action="store_true")
        a = p.parse_args()
        print("local rank", a.local_rank, os.environ["LOCAL_RANK"], a.synch)
    """))
    out = subprocess.run([sys.executable, "-m", "torchtools.launch", "--nproc_per_node=2",
                          str(script), "--synch"], capture_output=True, text=True, env=clean_env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "FutureWarning" in out.stderr and "torch.distributed.launch is deprecated" in out.stderr
    said = sorted(l.split(": ", 1)[1] for l in out.stdout.splitlines())
    assert said == ["local rank 0 0 True", "local rank 1 1 True"], out.stdout


def test_one_device_without_synch_and_a_clear_error_without_a_launcher(monkeypatch, tmp_path):
    from torchtools.torchhandy import Parallel_Trainer

    class Config:
        n_gpus = 2
        device = "cpu"

    trainer = Parallel_Trainer(False, Config())
    assert trainer.get_device() == "cpu"
    model = trainer.model_parallel(torch.nn.Linear(2, 1))
    assert trainer.get_model(model) is model and model.training
    assert trainer.dataset_parallel([1, 2, 3]) is None
    assert sorted(int(b) for batch in trainer.get_loader(list(range(6)), 0, 4, 0) for b in batch) == list(range(6))
    assert trainer.call_func(lambda a, b=0: a + b, 1, b=2) == 3
    trainer.save_model({}, model, tmp_path / "m.pt")
    assert set(torch.load(tmp_path / "m.pt", weights_only=False)["state_dict"]) == {"weight", "bias"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK is not set: with synch=True"):
        Parallel_Trainer(True, Config())
