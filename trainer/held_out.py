"""An evaluation of the model on the held-out rows: the token-weighted validation loss of every dp
rank's rows and the data's evaluators' scores (held-out exact match, rewards), recorded in the
current step's row and the run's history."""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.protocols import Objective
from trainer.step_metrics import read_means


def val_metrics(objective: Objective, val_loss: float, extra: dict[str, float]) -> dict[str, float]:
    """An evaluation's row: ``val/loss``, ``val/ppl`` (exp of the loss, capped at e^50) when the loss
    is a mean NLL per token (``objective.count_unit == "tokens"``; not for a pair loss), and ``extra``."""
    ppl = {"val/ppl": math.exp(min(val_loss, 50.0))} if getattr(objective, "count_unit", "tokens") == "tokens" else {}
    return {"val/loss": val_loss, **ppl, **extra}


@torch.no_grad()
def evaluate(task: Any) -> float | None:
    """Token-weighted validation loss over the held-out rows of all dp ranks (None without any) of
    ``task`` (the run's `trainer.task.Task`).

    Records `val_metrics` in the current step's row and an entry in the task's history.
    """
    strategy = task.trainer.strategy
    loader = task.trainer.datamodule.eval_dataloader()
    was_training = task.model.training
    task.model.eval()
    totals = torch.zeros(2, device=task.device)
    task.objective.pop_sums()  # drop stray sums: the next ones are this evaluation's
    with task.trainer.precision_plugin.forward_context():
        for batch in loader:
            batch = strategy.shard_batch({k: v.to(task.device) for k, v in batch.items()})
            totals[0] += strategy.eval_loss_sum(task.model, batch, task.objective.loss_sum)
            totals[1] += task.objective.num_tokens(batch)
        extra = read_means(task.pop_means("val"))
        # The data's evaluators score the model beyond the loss (held-out exact match per SFT source).
        for evaluator in task.trainer.datamodule.evaluators():
            extra.update(evaluator.evaluate(task.model, task.device))
    strategy.all_reduce_sum(totals, "dp_cp")
    task.model.train(was_training)
    if totals[1].item() == 0:  # no validation rows (data.val_fraction=0): no loss figure, rather than 0.0
        if extra:  # the evaluators' scores still count (held-out rewards of prompts without answers)
            task.record(extra)
            task.history.append({"step": task.global_step, "val_loss": None, "metrics": extra})
        return None
    val_loss = (totals[0] / totals[1]).item()
    task.record(val_metrics(task.objective, val_loss, extra))
    entry = {"step": task.global_step, "val_loss": val_loss}
    task.history.append({**entry, "metrics": extra} if extra else entry)
    return val_loss
