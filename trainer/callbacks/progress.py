"""A progress bar whose total (and so its ETA) counts the steps left in the run, not the epoch."""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, sized ``min(batches left in the epoch, trainer.max_steps - global_step)``."""

    @property
    @override
    def total_train_batches(self) -> int | float:
        total = super().total_train_batches
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return total
        done_in_epoch = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return min(total, done_in_epoch + max_steps - self.trainer.global_step)
