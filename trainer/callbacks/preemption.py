"""A stop signal on any rank (SIGTERM, or SLURM's pre-emption signal) becomes one step at which
every rank saves a checkpoint and exits.

Schedulers ask a job to stop with a signal and kill it a grace period later: Kubernetes and
torchrun send SIGTERM, SLURM sends SIGTERM at pre-emption or time-out and, with
``sbatch --signal=USR1@90``, SIGUSR1 90 s before. A signal may reach one rank only (``kill`` of
the launching process), all of them at slightly different steps, or arrive during a collective,
so the handler only sets a flag; every step starts an asynchronous MAX all-reduce of the flags on
a CPU (gloo) group of its own, and the step's end waits for it, so all ranks learn the same
answer at the same step, at no cost to the step (the reduction overlaps it, no device sync).

Lightning's own SIGTERM handler broadcasts inside the handler (a collective from a signal
handler, which can deadlock) and saves nothing; `StopSignals.install` replaces it for the
training loop (Lightning restores the original handlers at teardown).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 143  # 128 + SIGTERM: what a job killed by SIGTERM reports


class Stopped(SystemExit):
    """The run saved a checkpoint and stops on signal ``signum`` (exit code `EXIT_CODE`)."""

    def __init__(self, signum: int | None = None) -> None:
        super().__init__(EXIT_CODE)
        self.signum = signum


class StopSignals:
    """The agreed stop flag of all ranks, one value per optimizer step.

    Call `install` once the process group exists (every rank), `start_step` at the start of each
    step and `agreed` at its end (every rank, same steps).
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this rank received
        self._flag = torch.zeros(1)
        self._group: Any = None
        self._work: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # only a flag: the handler may interrupt a collective

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        if dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # CPU: no device sync, overlaps the step

    def start_step(self) -> None:
        if self._group is None:
            return
        self._flag.fill_(float(self.received or 0))
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def agreed(self) -> int | None:
        """The signal some rank received before this step started (None: go on)."""
        if self._group is None:
            return self.received
        if self._work is None:
            return None
        self._work.wait()
        self._work = None
        return int(self._flag.item()) or None


def stop_message(signum: int, step: int, checkpoint: str | None) -> str:
    saved = f"saved {checkpoint}" if checkpoint else "no checkpoint callback: nothing saved"
    return (
        f"plait: {signal.Signals(signum).name} received: stopped after step {step}, {saved}; "
        f"continue with resume=last (exit {EXIT_CODE})"
    )
