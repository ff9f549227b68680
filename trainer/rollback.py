"""``train.nonfinite=rollback``: the live model goes back to the checkpoint from before an anomaly."""

from __future__ import annotations

from typing import Any

from trainer.catalog import say


def roll_back(task: Any) -> None:
    """In ``task`` (the run's `trainer.task.Task`): reloads the weights and optimizer state of the checkpoint from before the anomaly
    (`NonFiniteGuard.rollback_due`) into the live model, on every rank (DCP is collective;
    the guard's state is equal on all of them). The step count, the LR schedule and the data
    position go on: the next steps train on the data after the anomalous ones, as PaLM
    restarted about 100 steps before a spike and skipped 200-500 batches."""
    path = task.nonfinite.rollback_due
    assert path is not None
    # The checkpoint's param groups would also bring back its hyperparameters (a resumed run's
    # resume_override=[optim.lr] among them): the run's own stay.
    optimizers = [getattr(opt, "_optimizer", opt) for opt in task.trainer.optimizers]
    groups = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    task.trainer.strategy.load_checkpoint(path)
    for opt, kept in zip(optimizers, groups):
        for group, hyper in zip(opt.param_groups, kept):
            group.update(hyper)
    task.nonfinite.rolled_back()
    task.record({"train/rollbacks": float(task.nonfinite.rollbacks)})
    if task.trainer.is_global_zero:
        say(
            f"warning: rolled back at step {task.global_step} to {path.name}, the checkpoint before the "
            f"anomalous steps from step {task.nonfinite.first['step'] if task.nonfinite.first else '?'} on "
            f"({task.nonfinite.counts()} so far; rollback {task.nonfinite.rollbacks} of train.max_rollbacks="
            f"{task.nonfinite.max_rollbacks}); training goes on with the data after them"
        )
