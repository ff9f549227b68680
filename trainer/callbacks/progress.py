"""A progress bar whose total (and so its ETA) counts the steps left in the run, not the epoch,
and whose ``val/loss`` is the newest evaluation's (also the one after the last step)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from strategies.core.ranges import NON_NEGATIVE


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, sized ``min(batches left in the epoch, trainer.max_steps - global_step)``
    and redrawn at most every ``refresh_interval_s`` seconds. It shows ``val/loss`` of the newest
    evaluation (`trainer.task.Task.latest_val_loss`) and not a logger's version (``v_num``).

    Args:
        refresh_interval_s: least seconds between two redraws of the training bar (0: every step,
            as Lightning does). A redraw reads every logged metric and writes to the terminal,
            a few milliseconds: a large share of a short step. The last step is always drawn.

    Raises:
        ValueError: a negative ``refresh_interval_s``.
    """

    def __init__(self, refresh_interval_s: Annotated[float, NON_NEGATIVE] = 0.5) -> None:
        if refresh_interval_s < 0:
            raise ValueError("callbacks.progress.refresh_interval_s must be >= 0")
        super().__init__()
        self.refresh_interval_s = refresh_interval_s
        self._last_refresh = float("-inf")
        self._resumed_at = 0  # the steps of its epoch a run resumed inside had done (0 at an epoch's start)

    @property
    @override
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return super().total_train_batches
        # Not Lightning's min(epoch, steps left): a resumed run's batch index counts from the epoch's
        # start, so a total of the steps left alone (4 of 12 after step 8) fell below it and tqdm showed "9/?".
        return min(self.trainer.num_training_batches, self._resumed_at + max_steps - self.trainer.global_step)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Resumed inside an epoch, Lightning skips the hook that sizes the bar: sized here, counting
        # on from the steps done (its rate and ETA from this run's steps only). At a later epoch's
        # start the loop's count still holds the previous epoch's: it is read here only.
        self._resumed_at = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if self._resumed_at:
            self.on_train_epoch_start(trainer)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.n = self.train_progress_bar.initial = self._resumed_at
        self._resumed_at = 0

    @override
    def get_metrics(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        val_loss = getattr(pl_module, "latest_val_loss", None)
        if val_loss is not None:
            metrics["val/loss"] = val_loss
        return metrics

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now - self._last_refresh < self.refresh_interval_s and batch_idx + 1 != self.train_progress_bar.total:
            return
        self._last_refresh = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
