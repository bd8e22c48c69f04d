"""``torchtools.slurm``: the job and run a Python trainer is in, Slurm's warning as a
flag, and its own requeue, first from the variables alone, then under a real Slurm
(Debian's ``slurmctld``/``slurmd``, started by ``cargo xtask test`` for these tests, its
``slurm.conf`` in ``TORCHTOOLS_TEST_SLURM_CONF``): a trainer signalled as at its time
limit checkpoints, requeues its own array task and ends, in its second run, with an
uninterrupted run's parameters, bit for bit."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from torchtools import BadRequestError, slurm

# A trainer as users write one with torchtools.slurm: it checkpoints on Slurm's warning
# and requeues itself (``requeue_and_exit``), resumes from its checkpoint, and knows its
# run. On its first run, with ``TT_WAIT=1``, it waits at step 20 for the signal, so the
# test is driven by what the job says, not by time.
TRAIN = r"""
import os, sys, time
import torch
from torchtools import slurm

ckpt, out = sys.argv[1:3]
stop = slurm.Signals()
job = slurm.job()
run = job.run if job else 1
if job:
    print("in Slurm job", job.id, "run", job.run, "gpus", job.gpus, job.gpus_from, flush=True)
else:
    print("not in a Slurm job", flush=True)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = torch.randn(64, 8, generator=g)
target = data.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    print("resumed at step", step, "in run", run, flush=True)
while step < 40:
    if step == 20 and run == 1 and os.environ.get("TT_WAIT") == "1":
        print("waiting for Slurm's signal at step", step, flush=True)
        while not stop:
            time.sleep(0.05)
    if stop:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        print("checkpointed on", stop.received.name, "at step", step, flush=True)
        slurm.requeue_and_exit()
    i = step % 8 * 8
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(data[i:i + 8]), target[i:i + 8]).backward()
    opt.step()
    step += 1
with open(out, "w") as f:
    f.write(b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex())
print("trained in run", run, flush=True)
"""

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_STEP_GPUS",
    "SLURM_JOB_GPUS",
    "SLURM_RESTART_COUNT",
    "SLURM_PROCID",
    "RANK",
    "TORCHTOOLS_REQUEUES_SLURM_JOB",
)


@pytest.fixture
def no_slurm(monkeypatch):
    """This process as outside Slurm (whatever the machine running the tests is)."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def run_python(code, env, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_the_job_its_array_task_its_gpus_and_its_run_come_from_slurms_variables(no_slurm):
    assert slurm.job() is None
    assert slurm.restart_count() == 0
    no_slurm.setenv("SLURM_JOB_ID", "40")
    no_slurm.setenv("SLURM_ARRAY_JOB_ID", "38")
    no_slurm.setenv("SLURM_ARRAY_TASK_ID", "2")
    no_slurm.setenv("SLURM_JOB_GPUS", "0-3")
    no_slurm.setenv("SLURM_STEP_GPUS", "2,3")
    no_slurm.setenv("SLURM_RESTART_COUNT", "1")
    job = slurm.job()
    assert job == slurm.Job(id="38_2", gpus=[2, 3], gpus_from="SLURM_STEP_GPUS", restart_count=1)
    assert job.run == 2
    no_slurm.setenv("SLURM_STEP_GPUS", "gpu2")
    with pytest.raises(BadRequestError, match='SLURM_STEP_GPUS="gpu2"'):
        slurm.job()


def test_signals_is_a_flag_set_by_slurms_warning_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with slurm.Signals() as stop:
        assert not stop
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not stop and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop and stop.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.received == signal.SIGUSR1, "the first signal is the one said"
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize(
    "env, who",
    [
        ({}, "not in slurm"),
        ({"SLURM_JOB_ID": "42", "TORCHTOOLS_REQUEUES_SLURM_JOB": "42"}, "torchtools"),
        ({"SLURM_JOB_ID": "42", "SLURM_PROCID": "1"}, "rank zero"),
    ],
)
def test_requeue_and_exit_exits_75_leaving_the_requeue_to_whoever_does_it(clean_env, env, who):
    """Outside Slurm, under ``torchtools reserve --requeue`` and on a rank other than 0,
    the trainer does not run ``scontrol`` (it is not on PATH here: running it would be
    said as an error) and exits 75."""
    child = {k: v for k, v in clean_env.items() if k not in SLURM_VARS}
    child.update(env, PATH=os.path.dirname(sys.executable))
    out = run_python(
        """
        from torchtools import slurm
        print(slurm.requeue(), flush=True)
        slurm.requeue_and_exit()
        """,
        child,
    )
    assert (out.returncode, out.stdout.strip(), out.stderr) == (75, who, "")


def test_a_requeue_slurm_refuses_is_said_and_still_exits_75(clean_env):
    child = {k: v for k, v in clean_env.items() if k not in SLURM_VARS}
    child.update(SLURM_JOB_ID="42", PATH=os.path.dirname(sys.executable))
    out = run_python("from torchtools import slurm\nslurm.requeue_and_exit()", child)
    assert out.returncode == 75, out
    assert "the job was not requeued" in out.stderr and "scontrol" in out.stderr, out.stderr


# Under the real Slurm.


@pytest.fixture
def cluster(tmp_path, clean_env):
    """The environment that reaches the test cluster, the trainer written in
    ``tmp_path`` and an uninterrupted run's parameters in ``ref.out``."""
    conf = os.environ.get("TORCHTOOLS_TEST_SLURM_CONF")
    if not conf:
        pytest.skip("no Slurm cluster: `cargo xtask test` starts one (as root)")
    env = {k: v for k, v in clean_env.items() if k not in SLURM_VARS}
    env.update(
        SLURM_CONF=conf,
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        TORCHTOOLS_LOCK_DIR=str(tmp_path / "locks"),
        XDG_STATE_HOME=str(tmp_path / "state"),
    )
    (tmp_path / "locks").mkdir()
    (tmp_path / "train.py").write_text(TRAIN)
    ref = subprocess.run(
        [sys.executable, "train.py", "ref.ckpt", "ref.out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0 and "not in a Slurm job" in ref.stdout, ref
    return env


def scontrol_show(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return out.stdout + out.stderr


def until(what, ready, log, limit=300):
    deadline = time.monotonic() + limit
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {limit} s\n{log()}"
        time.sleep(0.2)


def signal_until_requeued_and_completed(env, job, log):
    """Slurm's warning to every process of ``job`` (what ``--signal=USR1@90`` sends
    before the limit), then Slurm's word that the job completed after one requeue."""
    subprocess.run(["scancel", "--signal=USR1", "--full", job], env=env, check=True)

    def completed():
        said = scontrol_show(env, job)
        assert "JobState=FAILED" not in said and "JobState=CANCELLED" not in said, (
            said + log()
        )
        return "JobState=COMPLETED" in said

    until(f"Slurm job {job} completes", completed, log)
    assert "Restarts=1" in scontrol_show(env, job), scontrol_show(env, job) + log()


def test_a_python_reservation_in_a_slurm_step_takes_only_the_steps_gpus(tmp_path, cluster, command):
    """``srun --gres=gpu:1`` of a Python script: the other GPU of the node is refused,
    naming Slurm's variable; the step's own is reserved, and ``torchtools locks`` names
    the job."""
    script = tmp_path / "reserve.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess
        from torchtools import BadRequestError, reserve_gpu_for_training, slurm
        job = slurm.job()
        mine = job.gpus[0]
        print("step", job.id, "gpus", job.gpus, job.gpus_from, flush=True)
        try:
            reserve_gpu_for_training(gpu=1 - mine, fence=False).acquire()
            print("not refused", flush=True)
        except BadRequestError as e:
            print("refused:", e, flush=True)
        with reserve_gpu_for_training(gpu=mine, fence=False) as r:
            print("held", r.gpus, flush=True)
            print(subprocess.run([{command!r}, "locks"], capture_output=True, text=True).stdout)
    """))
    out = subprocess.run(
        ["srun", "--gres=gpu:1", f"--chdir={tmp_path}", sys.executable, str(script)],
        env=cluster, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out
    said = out.stdout
    step = said.split()[1]
    assert "gpus [" in said and "SLURM_STEP_GPUS" in said, said
    assert "refused:" in said and "SLURM_STEP_GPUS=" in said and "not refused" not in said, said
    assert f"in Slurm job {step}" in said, said


def test_a_python_trainer_requeues_its_own_array_task_and_resumes_bit_for_bit(tmp_path, cluster):
    script = tmp_path / "array.sh"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$SLURM_ARRAY_TASK_ID" = 1 ]; then export TT_WAIT=1; fi\n'
        'exec python train.py "job-$SLURM_ARRAY_TASK_ID.ckpt" "job-$SLURM_ARRAY_TASK_ID.out"\n'
    )
    out = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--array=0-1", "--gres=gpu:1", "--open-mode=append",
         f"--output={tmp_path}/job-%a.log", f"--chdir={tmp_path}", str(script)],
        env=cluster, capture_output=True, text=True,
    )
    assert out.returncode == 0, out
    array = out.stdout.strip()
    task = f"{array}_1"

    def log(i=1):
        path = tmp_path / f"job-{i}.log"
        return path.read_text() if path.exists() else ""

    until("task 1 waits for Slurm's signal", lambda: "waiting for Slurm's signal" in log(), log)
    signal_until_requeued_and_completed(cluster, task, log)
    until(f"task 0 completes", lambda: "JobState=COMPLETED" in scontrol_show(cluster, f"{array}_0"),
          lambda: log(0))
    assert "Restarts=0" in scontrol_show(cluster, f"{array}_0")
    for line in [
        f"in Slurm job {task} run 1 gpus",
        "checkpointed on SIGUSR1 at step 20",
        f"torchtools: requeuing Slurm job {task}, whose next run resumes (SLURM_RESTART_COUNT=1)",
        f"in Slurm job {task} run 2 gpus",
        "resumed at step 20 in run 2",
        "trained in run 2",
    ]:
        assert line in log(), f"no {line!r} in\n{log()}"
    assert "SLURM_JOB_GPUS" in log(), log()
    assert "trained in run 1" in log(0), log(0)
    ref = (tmp_path / "ref.out").read_text()
    for i in range(2):
        assert (tmp_path / f"job-{i}.out").read_text() == ref, f"task {i}: not the uninterrupted run's"


def test_under_torchtools_reserve_requeue_the_trainer_leaves_the_requeue_to_it(tmp_path, cluster):
    """``sbatch ... --wrap 'torchtools reserve --requeue ... -- python train.py'``: the
    trainer's ``requeue_and_exit`` only exits 75 and torchtools requeues the job, once."""
    out = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--gres=gpu:1", "--open-mode=append",
         f"--output={tmp_path}/job.log", f"--chdir={tmp_path}", "--wrap",
         'exec torchtools reserve --requeue --gpu "$SLURM_JOB_GPUS" --no-fence -- '
         "python train.py job.ckpt job.out"],
        env=dict(cluster, TT_WAIT="1"), capture_output=True, text=True,
    )
    assert out.returncode == 0, out
    job = out.stdout.strip()

    def log():
        path = tmp_path / "job.log"
        return path.read_text() if path.exists() else ""

    until("the job waits for Slurm's signal", lambda: "waiting for Slurm's signal" in log(), log)
    signal_until_requeued_and_completed(cluster, job, log)
    assert f"the command exited 75 (it can resume): requeuing Slurm job {job}" in log(), log()
    assert "torchtools: requeuing Slurm job" not in log(), "requeued by the trainer too:\n" + log()
    assert "trained in run 2" in log(), log()
    assert (tmp_path / "job.out").read_text() == (tmp_path / "ref.out").read_text()
