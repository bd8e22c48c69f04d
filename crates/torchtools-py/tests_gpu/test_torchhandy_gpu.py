"""torchhandy's Parallel_Trainer with ``synch`` on a real GPU: launched by torchhandy's
own line (``python -m torchtools.launch --use_env``) with one process, it trains on
``cuda:0`` over NCCL and ends at the parameters of a plain PyTorch loop on the GPU."""

import socket
import subprocess
import sys

import torch

MAIN = """
import sys
import torch
import torch.distributed as dist
from torchtools.torchhandy import Parallel_Trainer

class Config(object):
    n_gpus = 1
    device = 'cuda'

trainer = Parallel_Trainer(True, Config())
device = trainer.get_device()
print("device", device, "backend", dist.get_backend(), flush=True)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=g, dtype=torch.float64)
y = x @ torch.arange(8, dtype=torch.float64).unsqueeze(1)
dataset = torch.utils.data.TensorDataset(x, y)
model = trainer.model_parallel(torch.nn.Linear(8, 1).double())
opt = torch.optim.SGD(model.parameters(), lr=0.02)
sampler = trainer.dataset_parallel(dataset)
for epoch in range(3):
    for xb, yb in trainer.get_loader(dataset, epoch, 8, 0, sampler):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
        loss.backward()
        opt.step()
trainer.save_model({"epoch": 3}, model, sys.argv[1])
params = torch.cat([p.detach().flatten() for p in trainer.get_model(model).parameters()])
print("params", params.cpu().tolist(), flush=True)
"""

REFERENCE = """
import torch
from torch.utils.data import DistributedSampler
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 8, generator=g, dtype=torch.float64)
y = x @ torch.arange(8, dtype=torch.float64).unsqueeze(1)
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Linear(8, 1).double().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.02)
sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for xb, yb in torch.utils.data.DataLoader(dataset, 8, sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb.cuda()), yb.cuda()).backward()
        opt.step()
print("params", torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist())
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def params_of(out):
    line = [l for l in out.splitlines() if "params [" in l]  # the launcher tags each line
    assert len(line) == 1, out
    return torch.tensor(eval(line[0].split("params ", 1)[1]), dtype=torch.float64)


def test_synch_on_one_gpu_trains_over_nccl_as_plain_pytorch(clean_env, lock_dir, tmp_path):
    main = tmp_path / "main.py"
    main.write_text(MAIN)
    saved = tmp_path / "model.pt"
    out = subprocess.run(
        [sys.executable, "-m", "torchtools.launch", "--nproc_per_node=1",
         f"--master_port={free_port()}", "--use_env", str(main), str(saved)],
        capture_output=True, text=True, env=clean_env, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device cuda:0 backend nccl" in out.stdout, out.stdout
    ref = subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True, text=True,
                         env=clean_env, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert torch.allclose(params_of(out.stdout), params_of(ref.stdout), rtol=0, atol=1e-12)
    ckpt = torch.load(saved, weights_only=False)
    assert ckpt["epoch"] == 3 and set(ckpt["state_dict"]) == {"weight", "bias"}
