"""Periodic, atomic, verified checkpoints with a ``last`` link and retention.

Lightning's ModelCheckpoint copies or links ``last.ckpt`` after a save and assumes single files;
plait checkpoints are DCP directories written atomically by the strategy (with a manifest of
checksums, `strategies.checkpoint.dcp`), so this callback only decides *when* to save, names the
directory, moves the ``last`` link atomically and prunes whole directories atomically.

It is a Lightning ``Checkpoint``: Lightning runs it after every other callback, so the step's
metrics row (written at the end of each step, `trainer.task.Task`) is on disk before the
checkpoint of that step exists; a resumed run drops the rows after its checkpoint
(`trainer.loggers`), so ``metrics.csv`` equals an uninterrupted run's: no lost, no duplicated rows.

With ``async_save``, a periodic save blocks the step only for the copy of the state
(`strategies.checkpoint.async_save`); the write goes on during the next steps. The step whose start
found every rank's write done seals the checkpoint (manifest, rename), then moves ``last`` and
prunes; a save waits for the one in flight first, and the end of training, a stop signal and an
error finish it. Until sealed, a checkpoint is a ``.tmp`` directory that ``resume=last`` ignores.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Annotated, Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from strategies.checkpoint.async_save import AsyncWriter
from strategies.checkpoint.dcp import CheckpointError
from strategies.core.ranges import NON_NEGATIVE
from strategies.runtime.terminal import write_line
from trainer.callbacks.preemption import Stopped, StopSignals, stop_message
from trainer.loggers import RunCSVLogger
from trainer.rundir import LAST, SUPERSEDED, last_link_problem, step_checkpoints, step_dir, step_dirs
from trainer.task import Task

_TRASH = ".pruned-"


def remove_dir(path: Path) -> None:
    """Removes a checkpoint directory atomically: renamed out of the ``step_*`` names first, so
    a kill in the middle never leaves a partial directory that looks like a checkpoint."""
    trash = path.with_name(f"{_TRASH}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    path.rename(trash)
    shutil.rmtree(trash)


def point_last(checkpoint: Path) -> None:
    """Points the ``last`` link beside ``checkpoint`` at it, atomically: ``last`` always names a
    complete checkpoint."""
    link = checkpoint.parent / LAST
    tmp = checkpoint.parent / f".{LAST}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        tmp.symlink_to(checkpoint.name)
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)  # left only when the move failed


def set_aside_newer(dirpath: Path, step: int) -> str | None:
    """Moves the ``step_*`` checkpoints of ``dirpath`` newer than ``step`` (the one a run resumed from)
    to ``dirpath/superseded/after_step_<step>/``, and ``last`` to ``step``'s checkpoint when it is here
    (removed when it named a moved one and the run resumed from elsewhere); returns the line that
    says so (None: nothing newer).

    A run resumed from an older checkpoint of its own directory (the recovery from a divergence:
    ``resume=.../step_N resume_override=[optim.lr]``) trains a new course from step N; the newer
    checkpoints belong to the course it left. Left among its own, retention kept them (the highest
    steps) and deleted the new ones, and ``resume=last`` went on from the abandoned course. They
    are moved, not deleted: nothing a user may still want is lost.
    """
    newer = [p for p in step_dirs(dirpath) if int(p.name[5:]) > step]
    if not newer:
        return None
    aside = dirpath / SUPERSEDED / f"after_step_{step:07d}"
    n = 1
    while aside.exists():
        n += 1
        aside = dirpath / SUPERSEDED / f"after_step_{step:07d}.{n}"
    aside.mkdir(parents=True)
    for path in newer:
        path.rename(aside / path.name)
    if (here := step_dir(dirpath, step)).is_dir() and (dirpath / LAST).is_symlink():
        point_last(here)
    elif (dirpath / LAST).is_symlink() and not (dirpath / LAST).exists():
        # resumed from elsewhere (superseded/, another run): a ``last`` left naming a moved checkpoint made
        # a kill before this course's first save refuse both resume=last and a fresh start (a reviewer)
        (dirpath / LAST).unlink()
    names = ", ".join(p.name for p in newer)
    return (
        f"resumed from step {step}: the {len(newer)} newer checkpoint(s) of the course this run left ({names}) "
        f"moved to {aside} (retention and resume=last now see this course only; delete them when not needed)"
    )


class PeriodicCheckpoint(Checkpoint):
    """Saves every ``every_n_steps`` optimizer steps, at the end of training, and when the job is
    told to stop (SIGTERM or SIGUSR1 on any rank: every rank saves, then the run exits 143; see
    `trainer.callbacks.preemption`).

    Args:
        dirpath: directory of the step_* checkpoints (the trainer sets ``<run_dir>/checkpoints``).
        every_n_steps: save interval in optimizer steps (0: only at the end).
        keep_last: how many complete step_* checkpoints to keep (0 keeps all).
        save_on_signal: save and stop on SIGTERM / SIGUSR1 (False: Lightning's handling).
        async_save: periodic saves write in the background; training waits only for the copy of
            the state (the saves of the last step and on a signal stay synchronous).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: Annotated[int, NON_NEGATIVE] = 100,
        keep_last: Annotated[int, NON_NEGATIVE] = 2,
        save_on_signal: bool = True,
        async_save: bool = False,
    ) -> None:
        if every_n_steps < 0 or keep_last < 0:
            raise ValueError("callbacks.checkpoint.every_n_steps and keep_last must be >= 0")
        self.dirpath = Path(dirpath) if dirpath else None
        self.every_n_steps, self.keep_last = every_n_steps, keep_last
        self.stop_signals = StopSignals() if save_on_signal else None
        self._last_saved = -1
        self._started = False  # whether this process trains (on_train_start)
        self._last_published = -1  # the step of the newest complete checkpoint `last` names (rank 0)
        self.async_save = async_save
        self._writer: AsyncWriter | None = None  # made at the first background save (its groups are collective)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = True
        if self.stop_signals is not None:
            self.stop_signals.install()  # after Lightning's handlers, which it restores at teardown
        if trainer.ckpt_path is not None:
            for logger in trainer.loggers:  # the rows of the steps after the resumed one belong to another course
                if isinstance(logger, RunCSVLogger):
                    logger.drop_after(trainer.global_step)
        if trainer.ckpt_path is not None and trainer.is_global_zero and self.dirpath is not None:
            if (line := set_aside_newer(self.dirpath, trainer.global_step)) is not None:
                write_line(f"plait: {line}")

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.stop_signals is not None:
            self.stop_signals.start_step()
        if self._writer is not None:
            self._writer.begin_poll()  # overlaps the step; its answer is read at the step's end

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        signum = self.stop_signals.agreed() if self.stop_signals is not None else None
        if self._writer is not None and self._writer.all_written():
            self._finish(trainer)
        # The run's last step (max_steps, or a stop another callback or the task asked for: Lightning
        # runs this callback after the others) is saved here, not in on_train_end: there Lightning has
        # closed the epoch, and a run trained longer from that checkpoint would skip the rest of it.
        last_step = 0 < trainer.max_steps <= step or trainer.should_stop
        if signum is not None or (self.every_n_steps and step % self.every_n_steps == 0) or last_step:
            # A signal's save and the last step's are complete before the run ends.
            background = self.async_save and signum is None and not last_step
            with pl_module.off_step():  # summary.json's tokens/s leaves the save's blocked time out
                path = self.save(trainer, background=True) if background else self.save(trainer)
        if signum is not None:
            if trainer.is_global_zero:
                write_line(stop_message(signum, step, str(path)))  # on a line of its own, under the progress bar
            raise Stopped(signum)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer)
        if trainer.global_step != self._last_saved:
            self.save(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # The other ranks may not be here (an error on one rank): seal only if all come, publish without a barrier.
        path = self._writer.finish_after_error() if self._writer is not None else None
        if path is not None and trainer.is_global_zero:
            self._move_last(path)
        # Not in a fork launcher's parent, which trained nothing (on_train_start ran in its children).
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero and self._started:
            published = self._last_published if path is None else int(path.name.removeprefix("step_"))
            write_line(interrupt_message(trainer.global_step, published, self.dirpath))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def save(self, trainer: L.Trainer, background: bool = False) -> Path:
        """Writes the checkpoint of the current step (every rank), then moves ``last`` to it and
        prunes (rank 0); a save in the background does those once it is written (`_finish`).

        Raises:
            CheckpointError: ``last`` is not a link this save can move (checked before writing,
                on every rank), or the checkpoint could not be written (a full disk).
        """
        self._finish(trainer)  # at most one save in flight
        assert self.dirpath is not None, "PeriodicCheckpoint needs dirpath"
        problem = last_link_problem(self.dirpath) if trainer.is_global_zero else None
        if (problem := trainer.strategy.broadcast(problem)) is not None:
            raise CheckpointError(problem)
        path = step_dir(self.dirpath, trainer.global_step)
        for logger in trainer.loggers:  # the step's row is durable before its checkpoint exists
            if isinstance(logger, RunCSVLogger):
                logger.sync()
        # Collective; atomic and verified (strategies.checkpoint.dcp.save). Lightning's weights_only=False:
        # the loop, optimizer and callback states too, not only the weights.
        if background:
            self._writer = self._writer or AsyncWriter()
            trainer.save_checkpoint(path, weights_only=False, storage_options=self._writer)  # sealed by `_finish`
            self._last_saved = trainer.global_step
            return path
        trainer.save_checkpoint(path, weights_only=False)
        self._last_saved = trainer.global_step
        self._publish(trainer, path)
        return path

    def _finish(self, trainer: L.Trainer) -> None:
        """Seals the save in flight, if any (every rank; waits for its write), then publishes it."""
        if self._writer is not None and (path := self._writer.finish()) is not None:
            self._publish(trainer, path)

    def _publish(self, trainer: L.Trainer, path: Path) -> None:
        """Moves ``last`` to the complete checkpoint ``path`` and prunes (rank 0); then a barrier."""
        if trainer.is_global_zero:
            self._move_last(path)
            task = trainer.lightning_module
            self._prune(protect=task.nonfinite.safe_step() if isinstance(task, Task) else None)
        trainer.strategy.barrier()

    def _move_last(self, path: Path) -> None:
        self._last_published = int(path.name.removeprefix("step_"))
        point_last(path)

    def _prune(self, protect: int | None = None) -> None:
        """Keeps the ``keep_last`` newest complete checkpoints; removes every step_* directory
        older than the oldest kept one (and leftovers of interrupted saves and prunes), except,
        while the run recovers from an anomalous step, the newest complete checkpoint of a step
        ``<= protect`` (`trainer.nonfinite.NonFiniteGuard.safe_step`): the newer ones may hold
        the weights that led to the anomaly."""
        assert self.dirpath is not None
        for leftover in self.dirpath.iterdir():
            if leftover.name.startswith(_TRASH) or re.fullmatch(r"step_\d+\.(tmp|old)", leftover.name):
                shutil.rmtree(leftover, ignore_errors=True)
        if not self.keep_last:
            return
        complete = step_checkpoints(self.dirpath)
        kept = complete[-self.keep_last :]
        oldest_kept = int(kept[0].name[5:]) if kept else 0
        safe = [p for p in complete if protect is not None and int(p.name[5:]) <= protect][-1:]
        for old in step_dirs(self.dirpath):
            if int(old.name[5:]) < oldest_kept and old not in safe:
                remove_dir(old)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": self._last_saved}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved = self._last_published = state_dict["last_saved"]  # the checkpoint resumed from


def interrupt_message(step: int, last_saved: int, dirpath: str | None) -> str:
    """What Ctrl-C kept: a run stopped by SIGINT saves nothing (SIGTERM saves, `trainer.callbacks.preemption`)."""
    head = f"plait: interrupted (Ctrl-C) after step {step}"
    if last_saved < 0 or dirpath is None:
        return (
            f"{head}: no checkpoint was written, the run cannot be resumed (SIGTERM, kill -TERM <pid>, stops with one)"
        )
    lost = f"steps {last_saved + 1}-{step} are not saved; " if step > last_saved else ""
    return (
        f"{head}: {lost}continue from step {last_saved} with plait resume {Path(dirpath).parent} "
        "(SIGTERM, kill -TERM <pid>, stops with a checkpoint of the current step)"
    )
