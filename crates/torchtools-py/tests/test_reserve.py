"""reserve_gpu_for_training in the command's queue: seen by `torchtools locks` and
`usage`, waited for by another process, given up with Ctrl-C, refused past a timeout."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import torchtools
from torchtools import reserve_gpu_for_training


def locks(command):
    out = subprocess.run([command, "locks", "--json"], capture_output=True, text=True, check=True)
    return {l["holder"]["gpu"]: l for l in json.loads(out.stdout)["locks"] if l["held"]}


def waiters(command):
    out = subprocess.run([command, "queue", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["waiters"]


def python(code, env):
    """A child Python running `code`, its output read line by line."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_the_default_safety_margin_is_the_rust_fences_own():
    """One number: the margin a Python reservation leaves by default is the one the Rust
    fence (tt-fence's DEFAULT_SAFETY_MARGIN) leaves, 50 MiB as in the Python torchtools."""
    import inspect

    from torchtools import _native, gpu_lock

    assert _native.DEFAULT_SAFETY_MARGIN_BYTES == 50 * 1024**2
    assert gpu_lock.DEFAULT_SAFETY_MARGIN_BYTES == _native.DEFAULT_SAFETY_MARGIN_BYTES
    default = inspect.signature(reserve_gpu_for_training).parameters["safety_margin_bytes"].default
    assert default == _native.DEFAULT_SAFETY_MARGIN_BYTES


def test_a_reservation_is_in_the_commands_view_and_released_on_exit(lock_dir, command):
    with pytest.raises(ValueError):
        with reserve_gpu_for_training(gpu=0, fence=False, training_reserved_bytes=1 << 30) as r:
            assert r.gpus == ["0"] and r.held
            held = locks(command)["0"]["holder"]
            assert held["pid"] == __import__("os").getpid()
            assert held["reserved"] == 1 << 30
            assert held["command"][0] == sys.executable
            raise ValueError("the training failed")
    # Released on the exception, and recorded with a failed status.
    assert not r.held
    assert locks(command) == {}
    usage = subprocess.run([command, "usage", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(usage.stdout)["rows"][0]["reservations"] == 1


def test_another_process_waits_its_turn_and_ctrl_c_gives_up(lock_dir, command, clean_env):
    with reserve_gpu_for_training(gpu=0, fence=False):
        # Another process, past a timeout or not blocking: GpuBusyError.
        for kwargs in ('timeout="200ms"', "blocking=False"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import torchtools\n"
                    "try:\n"
                    f"    torchtools.reserve_gpu_for_training(gpu=0, fence=False, {kwargs}).acquire()\n"
                    "except torchtools.GpuBusyError as e:\n"
                    "    print('busy:', e)\n",
                ],
                capture_output=True,
                text=True,
                env=clean_env,
                timeout=120,
            )
            assert out.stdout.startswith("busy:") and "locked by pid" in out.stdout, out
        # This process again: refused, not a wait for itself.
        with pytest.raises(torchtools.TorchtoolsError, match="already locked by this process"):
            reserve_gpu_for_training(gpu=0, fence=False).acquire()
        waiter = python(
            """
            import signal
            from torchtools import reserve_gpu_for_training
            # Ctrl-C as at a terminal, whatever this test was started under (a shell
            # starts background jobs with SIGINT ignored, and Python keeps that).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("waiting", flush=True)
            try:
                with reserve_gpu_for_training(gpu=0, fence=False):
                    print("got it", flush=True)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            """,
            clean_env,
        )
        assert waiter.stdout.readline() == "waiting\n"
        deadline = time.monotonic() + 120
        while len(waiters(command)) != 1:
            assert time.monotonic() < deadline, "the child never queued"
            time.sleep(0.05)
        waiter.send_signal(signal.SIGINT)
        out, err = waiter.communicate(timeout=120)
        assert out == "interrupted\n" and waiter.returncode == 0, err
    # Its turn never came; nothing of it stays held or queued.
    assert locks(command) == {}
    assert waiters(command) == []


def queued(command):
    """The requests `torchtools queue --json` lists (this test's lock directory)."""
    out = subprocess.run([command, "queue", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["waiters"]


def test_the_waiter_gets_the_gpu_when_it_is_released(lock_dir, command, clean_env):
    r = reserve_gpu_for_training(gpu=0, fence=False).acquire()
    waiter = python(
        """
        from torchtools import reserve_gpu_for_training
        print("waiting", flush=True)
        with reserve_gpu_for_training(gpu=0, fence=False, timeout="10m") as r:
            print("got", r.gpus, flush=True)
        """,
        clean_env,
    )
    assert waiter.stdout.readline() == "waiting\n"
    # Released only once the waiter is in the queue (else it may never have waited).
    deadline = time.monotonic() + 120
    while not any(w["pid"] == waiter.pid for w in queued(command)):
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.02)
    r.release()
    out, err = waiter.communicate(timeout=120)
    assert out == "got ['0']\n" and waiter.returncode == 0, err


def test_a_fence_without_nvml_falls_back_to_the_lock_with_a_warning(lock_dir, command):
    import torch

    if torch.cuda.is_available():
        # With a GPU the fence is raised: it holds memory.
        with reserve_gpu_for_training(gpu=0, training_reserved_bytes=1 << 30) as r:
            assert r.fenced_bytes > 0
        return
    with pytest.warns(RuntimeWarning, match="holding the lock alone"):
        with reserve_gpu_for_training(gpu=0) as r:
            assert r.held and r.fenced_bytes == 0


def test_bad_arguments_are_refused_before_waiting(lock_dir):
    with pytest.raises(torchtools.BadRequestError, match="timeout"):
        reserve_gpu_for_training(gpu=0, timeout="soon")
    with pytest.raises(torchtools.BadRequestError, match="gpu"):
        reserve_gpu_for_training(gpu=1.5)
    with pytest.raises(torchtools.BadRequestError):
        reserve_gpu_for_training(gpu="GPU-not-hex!", fence=False).acquire()
    # What Python code expects of a wrong argument: a ValueError (and still ours).
    with pytest.raises(ValueError, match="timeout") as raised:
        reserve_gpu_for_training(gpu=0, timeout="soon")
    assert isinstance(raised.value, torchtools.TorchtoolsError)
    assert issubclass(torchtools.BadRequestError, (RuntimeError,))


def test_probe_then_reserve_then_train(lock_dir, command):
    probe = torchtools.make_probe_fn(input_shape=(2, 3, 8, 8))
    assert torchtools.estimate_gpu_usage_by_probe(probe) >= 0

    def train(steps, seen):
        seen.append(locks(command)["0"]["holder"]["reserved"])
        return steps * 2

    seen = []
    result = torchtools.run_training_with_reservation(
        train,
        train_args=(5, seen),
        probe_fn=probe,
        reserve_kwargs={"gpu": 0, "fence": False, "training_reserved_bytes": 123456},
    )
    assert result == 10 and seen == [123456]
    assert locks(command) == {}


TRAIN = """
import os, signal, sys, time
import torch
from torchtools.checkpoint import load_state_dict, save_state_dict
from torchtools.cycling_utils import InterruptableDistributedSampler

ckpt, out = sys.argv[1], sys.argv[2]
# Steps a run trains before it waits for its time limit's SIGTERM (0: no wait): each
# run then moves the job on by as many steps, whatever the machine's speed.
per_run = int(os.environ.get("TT_STEPS_PER_RUN", "0"))
done_here = 0
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = torch.randn(40, 8, generator=g)
target = data.sum(1, keepdim=True) + 0.1 * torch.randn(40, 1, generator=g)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = InterruptableDistributedSampler(data, num_replicas=1, rank=0, seed=3)
if os.path.exists(ckpt):
    state, meta = load_state_dict(ckpt)
    model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    opt.step()  # creates the momentum buffers, then overwritten
    for i, p in enumerate(model.parameters()):
        opt.state[p]["momentum_buffer"] = state[f"momentum.{i}"].clone()
    sampler.load_state_dict(meta["values"]["sampler"])
    print("resumed at epoch", sampler.epoch, "progress", sampler.progress, flush=True)

def save():
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        state[f"momentum.{i}"] = opt.state[p]["momentum_buffer"]
    save_state_dict(state, ckpt, values={"sampler": sampler.state_dict()})

def cut():
    save()
    print("checkpointed on SIGTERM", flush=True)
    sys.exit(75)

while sampler.epoch < 3:
    batch = []
    for i in sampler:
        batch.append(i)
        if len(batch) < 4:
            continue
        while per_run and done_here >= per_run and not stop:
            time.sleep(0.05)
        if stop:
            cut()  # the batch drawn is not counted: the next run draws it again
        x, y = data[batch], target[batch]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sampler.advance(len(batch))
        batch = []
        done_here += 1
        if stop:
            cut()
    sampler.reset_progress()  # the epoch is done (cycling_utils' API)
    sampler.set_epoch(sampler.epoch + 1)
# Trained: a SIGTERM from here on (the time limit while Python shuts down) has nothing
# to stop.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(out, "w") as f:
    f.write(b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex())
"""


def test_a_requeued_job_cut_by_its_time_limit_resumes_bit_for_bit(lock_dir, command, clean_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # Uninterrupted, as the reference.
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ref.ckpt"), str(tmp_path / "ref.out")],
        check=True,
        env=clean_env,
    )
    # Detached, cut by --time every 6 s and requeued after each cut; each run trains
    # at most 10 of the 30 steps and then waits for the cut, so there are at least 3 runs.
    env = dict(clean_env, TT_STEPS_PER_RUN="10", XDG_STATE_HOME=str(tmp_path / "state"))
    job = subprocess.run(
        [command, "reserve", "--detach", "--requeue", "--time", "6s", "--grace", "60s",
         "--gpu", "0", "--no-fence", "--",
         sys.executable, str(script), str(tmp_path / "job.ckpt"), str(tmp_path / "job.out")],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()
    done = subprocess.run([command, "jobs", "wait", job], capture_output=True, text=True, timeout=600, env=env)
    log = subprocess.run([command, "logs", job], capture_output=True, text=True, env=env).stdout
    assert done.returncode == 0, log
    record = [j for j in json.loads(subprocess.run(
        [command, "jobs", "--json"], capture_output=True, text=True, check=True, env=env
    ).stdout) if j["id"] == job][0]
    assert record["runs"] >= 3, log
    assert record["state"] == f"finished (run {record['runs']})", record
    # (The last run may meet its limit too, as it shuts down: it finished all the same.)
    assert log.count("time limit (6s) reached: SIGTERM") >= record["runs"] - 1, log
    assert log.count("checkpointed on SIGTERM") == record["runs"] - 1, log
    assert log.count("requeued") == record["runs"] - 1, log
    assert (tmp_path / "job.out").read_text() == (tmp_path / "ref.out").read_text()
