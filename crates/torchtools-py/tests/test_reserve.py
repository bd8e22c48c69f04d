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
