"""Periodic, atomic checkpoints with a ``last`` link and retention.

Lightning's ModelCheckpoint copies or links ``last.ckpt`` after a save and assumes single files;
plait checkpoints are DCP directories written atomically by the strategy, so this callback only
decides *when* to save, names the directory, moves the ``last`` link atomically and prunes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from trainer.rundir import LAST, step_checkpoints, step_dir


class PeriodicCheckpoint(L.Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end of training.

    Args:
        dirpath: directory of the step_* checkpoints (the trainer sets ``<run_dir>/checkpoints``).
        every_n_steps: save interval in optimizer steps (0: only at the end).
        keep_last: how many step_* checkpoints to keep (0 keeps all).
    """

    def __init__(self, dirpath: str | None = None, every_n_steps: int = 100, keep_last: int = 2) -> None:
        if every_n_steps < 0 or keep_last < 0:
            raise ValueError("callbacks.checkpoint.every_n_steps and keep_last must be >= 0")
        self.dirpath = Path(dirpath) if dirpath else None
        self.every_n_steps, self.keep_last = every_n_steps, keep_last
        self._last_saved = -1

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.save(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_saved:
            self.save(trainer)

    def save(self, trainer: L.Trainer) -> Path:
        assert self.dirpath is not None, "PeriodicCheckpoint needs dirpath"
        path = step_dir(self.dirpath, trainer.global_step)
        self._last_saved = trainer.global_step
        trainer.save_checkpoint(path)  # collective; atomic (strategies.checkpoint.save)
        if trainer.is_global_zero:
            link = self.dirpath / LAST
            tmp = self.dirpath / f".{LAST}.tmp"
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(path.name)
            os.replace(tmp, link)  # atomic: `last` always names a complete checkpoint
            self._prune()
        trainer.strategy.barrier()
        return path

    def _prune(self) -> None:
        if not self.keep_last:
            return
        steps = step_checkpoints(self.dirpath)
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": self._last_saved}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved = state_dict["last_saved"]
