"""The Python package on a real GPU: `reserve_gpu_for_training` fences the card (a
plain PyTorch allocation past the reservation fails, here and in another process), the
`Tracker` sees a process's 2 GiB of GPU memory, and toma's API adapts on CUDA's own
out-of-memory errors (beside toma 1.1.0 itself on the same workload). Every size is a
fraction of the card it runs on (H100 80 GiB, H200 141 GiB)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtools import reserve_gpu_for_training

GIB = 1 << 30
MIB = 1 << 20


def card_bytes():
    return torch.cuda.get_device_properties(0).total_memory


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def child(code, env, timeout=300):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return out


def test_the_reservation_fences_the_gpu(lock_dir, clean_env):
    total = card_bytes()
    reserved = total // 10  # 8 GiB of an H100, 14 GiB of an H200
    margin = 256 * MIB
    with reserve_gpu_for_training(
        gpu=0, training_reserved_bytes=reserved, safety_margin_bytes=margin
    ) as r:
        assert r.held and r.device == torch.device("cuda", 0)
        assert r.fenced_bytes >= total // 2, r.fenced_bytes
        free = free_bytes()
        print(f"fence: {r.fenced_bytes / GIB:.2f} GiB fenced, {free / GIB:.2f} GiB free, "
              f"{reserved / GIB:.2f} GiB reserved of {total / GIB:.2f} GiB")
        # What is left is the reservation and its margin (less what this process's
        # CUDA context took since).
        assert reserved - GIB <= free <= reserved + margin + GIB
        # The training's own allocations fit ...
        x = torch.ones(int(reserved * 0.8) // 4, device=r.device)
        assert float(x[-1]) == 1.0
        # ... one past the reservation does not, here ...
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(reserved * 1.5), dtype=torch.uint8, device=r.device)
        del x
        torch.cuda.empty_cache()
        # ... nor in another process that ignores the queue.
        out = child(
            f"""
            import torch
            try:
                torch.empty({int(reserved * 1.5)}, dtype=torch.uint8, device="cuda")
                print("allocated")
            except torch.OutOfMemoryError:
                print("out of memory")
            """,
            clean_env,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "out of memory"
    assert not r.held
    # Released: the card is free again for both.
    assert free_bytes() >= total * 0.8
    y = torch.empty(int(reserved * 1.5), dtype=torch.uint8, device="cuda:0")
    del y
    torch.cuda.empty_cache()


TRACKED = """
import json, time, torch
from torchtools.gpu_tracker import Tracker
torch.ones(1, device="cuda")  # the CUDA context first: the 2 GiB below are on top
with Tracker(sleep_time=0.1, gpu_ram_unit="gigabytes", disable_logs=True) as tracker:
    x = torch.ones(2 * 1024**3 // 4, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)
    del x
    torch.cuda.empty_cache()
    time.sleep(0.3)
print(json.dumps(tracker.to_json()))
"""


def test_the_tracker_sees_a_processs_2_gib(clean_env):
    out = child(TRACKED, clean_env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    gpu = report["max_gpu_ram"]
    print(f"tracker: max GPU RAM main {gpu['main']:.3f} GB, system {gpu['system']:.3f} GB")
    assert gpu["unit"] == "gigabytes"
    # 2 GiB is 2.147 GB, and the context (a few hundred MB) comes on top.
    assert 2.147 <= gpu["main"] <= 2.147 + 2.0
    assert gpu["system_capacity"] >= card_bytes() / 1e9 * 0.99


TOMA = """
{import_line}
import json, sys, torch
sys.modules[toma.__module__].StacktraceMemoryBatchsizeCache.TRACK_RAM = False
UNIT = 256 << 20
total = torch.cuda.get_device_properties(0).total_memory
sizes, ooms = [], 0

@toma.batch(initial_batchsize=4 * total // UNIT)
def fill(batchsize):
    global ooms
    sizes.append(batchsize)
    try:
        x = torch.empty(batchsize * UNIT, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        ooms += 1
        raise
    x.fill_(1)
    ones = int(x[::UNIT].sum())
    del x
    torch.cuda.empty_cache()  # the caches key on the memory PyTorch holds: as before
    return ones

calls = []
for _ in range(5):
    before = ooms
    calls.append({{"result": fill(), "ooms": ooms - before}})
torch.cuda.empty_cache()
fits = torch.cuda.mem_get_info(0)[0] // UNIT
print(json.dumps({{"calls": calls, "sizes": sizes, "fits": fits}}))
"""


def run_toma(import_line, env):
    out = child(TOMA.format(import_line=import_line), env, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_toma_adapts_on_real_cuda_out_of_memory(clean_env):
    ours = run_toma("from torchtools.toma import toma", clean_env)
    print(f"torchtools.toma: {ours}")
    first = ours["calls"][0]
    # The first call started at 4x the card: CUDA's own errors, then a size that ran.
    assert first["ooms"] >= 2
    assert all(0 < c["result"] <= ours["fits"] for c in ours["calls"])
    try:
        import toma  # noqa: F401
    except ImportError:
        pytest.fail("toma 1.1.0 is not importable: the GPU bundle installs it beside ours")
    theirs = run_toma("from toma import toma", clean_env)
    print(f"toma 1.1.0: {theirs}")
    ours_ooms = sum(c["ooms"] for c in ours["calls"])
    theirs_ooms = sum(c["ooms"] for c in theirs["calls"])
    print(f"toma rows: ours {ours_ooms} OOMs, last batch {ours['calls'][-1]['result']}; "
          f"toma 1.1.0 {theirs_ooms} OOMs, last batch {theirs['calls'][-1]['result']}")
    # The same work done; by the last call a batch at least as large as toma's halving
    # keeps (ours backs up toward the largest that fits).
    assert ours["calls"][-1]["result"] >= theirs["calls"][-1]["result"]
