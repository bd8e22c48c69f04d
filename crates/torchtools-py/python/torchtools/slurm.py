"""Training inside a Slurm job: which job and which run this is, Slurm's warning and
time limit as a flag, and the requeue that lets a checkpointing trainer resume on its
own. Lightning's ``SLURMEnvironment(auto_requeue=True)`` does this for Lightning; this
module does it for any training loop, with the rules of the ``torchtools`` command::

    import sys
    from torchtools import slurm

    stop = slurm.Signals()            # SIGUSR1 (sbatch --signal=USR1@90) and SIGTERM
    step = resume_from_checkpoint()   # 0 on the job's first run
    while step < steps:
        if stop:
            save_checkpoint(step)
            slurm.requeue_and_exit()  # scontrol requeue, then exit 75
        train_one_step()
        step += 1

Submit it with ``sbatch --requeue --signal=USR1@90 --open-mode=append``. The requeued
run sees ``SLURM_RESTART_COUNT`` one higher (:func:`restart_count`) and resumes from
the checkpoint. Outside Slurm, :func:`requeue_and_exit` only exits 75, which
``torchtools run --detach --requeue`` runs again.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Iterable, List, NoReturn, Optional

from torchtools import _native
from torchtools._native import TorchtoolsError

__all__ = ["Job", "Signals", "job", "requeue", "requeue_and_exit", "restart_count"]

#: The exit status of a trainer stopped after checkpointing (sysexits' EX_TEMPFAIL):
#: not a failure; run the same command again to resume.
EXIT_REQUEUE = 75


@dataclass(frozen=True)
class Job:
    """The Slurm job this process runs in."""

    #: Its id as ``squeue`` and ``scancel`` take it: ``SLURM_JOB_ID``, or for an array
    #: task ``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` (``1234_7``).
    id: str
    #: The node's indices of the GPUs Slurm allocated (``None`` when it allocated none);
    #: reservations in this job choose only among them.
    gpus: Optional[List[int]]
    #: The variable they were read from: ``SLURM_STEP_GPUS`` (under ``srun``) or
    #: ``SLURM_JOB_GPUS`` (in the batch script).
    gpus_from: Optional[str]
    #: How many times Slurm requeued the job (``SLURM_RESTART_COUNT``).
    restart_count: int

    @property
    def run(self) -> int:
        """Which run of the job this is: 1, then 2 after Slurm's first requeue, ..."""
        return self.restart_count + 1


def job() -> Optional[Job]:
    """The Slurm job this process runs in, or ``None`` outside Slurm. A Slurm variable
    that does not hold what Slurm writes raises ``BadRequestError`` naming it."""
    found = _native.slurm_job()
    if found is None:
        return None
    id_, gpus, gpus_from = found
    return Job(id=id_, gpus=gpus, gpus_from=gpus_from, restart_count=restart_count())


def restart_count() -> int:
    """How many times Slurm requeued this process's job (``SLURM_RESTART_COUNT``): 0 on
    its first run, and outside Slurm."""
    return _native.slurm_restart_count()


class Signals:
    """Slurm's warning before a time limit (``SIGUSR1``, from ``sbatch
    --signal=USR1@90``), its time limit and preemption (``SIGTERM``) as a flag to test
    between steps: true once one arrived, so the trainer finishes its step, checkpoints
    and calls :func:`requeue_and_exit`. Installs its handlers at once (from the main
    thread, as Python requires); :meth:`restore`, or leaving a ``with`` block, puts the
    previous ones back. ``SIGINT`` is left to Python (``KeyboardInterrupt``) unless
    given in ``signals``.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
        #: The first signal that arrived (``None`` before).
        self.received: Optional[signal.Signals] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def __bool__(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        """Puts back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "Signals":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.restore()


def requeue() -> str:
    """Puts this process's Slurm job back in Slurm's queue (``scontrol requeue``; an
    array task alone), when this process is the one to, and says so on standard error:
    Slurm then ends the job's processes and runs it again. Returns who requeues it:
    ``"requeued"`` (done here); ``"torchtools"`` (under ``torchtools reserve
    --requeue`` or ``launch --requeue``, which requeue it when this process exits 75);
    ``"rank zero"`` (another task of the job does: ``SLURM_PROCID`` or ``RANK`` is not
    0); ``"not in slurm"``. Raises ``TorchtoolsError`` when Slurm refuses (a job not
    submitted requeueable, one stopped by ``torchtools stop``), saying why.
    """
    # What this process printed reaches the job's output before Slurm ends it.
    sys.stdout.flush()
    sys.stderr.flush()
    who, _job = _native.slurm_requeue_self()
    return who


def requeue_and_exit(status: int = EXIT_REQUEUE) -> NoReturn:
    """:func:`requeue`, then exits with ``status`` (75: the run can resume): call it
    after the checkpoint. A requeue Slurm refuses is said on standard error; the exit is
    the same (the checkpoint is written: submitting the job again resumes it).
    """
    try:
        requeue()
    except TorchtoolsError as e:
        print(f"torchtools: the job was not requeued: {e}", file=sys.stderr, flush=True)
    sys.exit(status)
