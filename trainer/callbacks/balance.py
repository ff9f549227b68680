"""Work balance telemetry: how uneven the ranks' steps are (``perf/balance_*`` in metrics.csv).

On every logging step each rank estimates the work of its rows of the step (`trainer.data.balance.
WorkModel` of the run's model shape: linear per token + attention per causal pair; the cp, tp and
pp ranks of one dp rank share its rows) and measures its training step's wall time (from the
batch's start to its end: forward, backward, optimizer). One all-reduce of both
(max and sum over every rank) gives:

- ``perf/balance_work_max_over_mean``: estimated work, slowest rank over the mean rank (1.0: even);
- ``perf/balance_time_max_over_mean``: measured step time, the same ratio;
- ``perf/balance_compute_max_over_mean``: measured forward/backward seconds before the step's
  gradient sync (`strategies.runtime.compute_timer.ComputeTimer`, a strategy's ``compute_timer``), the
  same ratio; ``perf/compute_s_max`` and ``perf/compute_s_mean``: those seconds.

Ranks that synchronise inside the step (FSDP gathers, DDP's all-reduce) wait for the slowest, so
the measured step times converge; the compute time leaves the gradient sync's wait out, and the
estimate shows the imbalance they pay for. Off by default
(``callbacks.balance.enabled=true``): it adds one small all-reduce per logging step.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from strategies.core.shape import ModelShape
from trainer.data.balance import WorkModel
from trainer.loggers import is_logging_step


def max_over_mean(values_rk: torch.Tensor) -> list[float]:
    """``[ranks, k]`` values of every rank (work, seconds, ...) -> each column's max over mean."""
    return (values_rk.amax(0) / values_rk.mean(0).clamp(min=1e-30)).tolist()


class BalanceTelemetry(L.Callback):
    """Logs ``perf/balance_work_max_over_mean`` and ``perf/balance_time_max_over_mean`` (module docstring).

    Args:
        enabled: switch; off, the callback does nothing.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._start, self._work = 0.0, 0.0
        self._model: WorkModel | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        timer = getattr(trainer.strategy, "compute_timer", None)  # MeshStrategy's; another strategy has none
        if timer is not None:
            timer.enabled = self.enabled
        run = getattr(trainer.strategy, "run", None)  # MeshStrategy's resolved run; another strategy has none
        if run is not None:
            shape = run.shape
        else:  # a model without the declared sizes: causal pairs alone (WorkModel.of)
            shape = None if ModelShape.problem(pl_module.model) else ModelShape.of(pl_module.model)
        self._model = WorkModel.of(shape)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled and self._model is not None and "document_ids" in batch:
            self._work = float(self._model.rows(batch["document_ids"].cpu()).sum())
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.enabled or not is_logging_step(trainer):
            return
        timer = getattr(trainer.strategy, "compute_timer", None)
        compute = timer.seconds if timer is not None else 0.0
        seconds = time.perf_counter() - self._start
        mine = torch.tensor([[self._work, seconds, compute]], dtype=torch.float64, device=pl_module.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            mine = torch.cat(gathered)
        work, seconds, compute = max_over_mean(mine.cpu())
        metrics = {"perf/balance_work_max_over_mean": work, "perf/balance_time_max_over_mean": seconds}
        if timer is not None:
            per_rank = mine[:, 2].cpu()
            metrics.update({
                "perf/balance_compute_max_over_mean": compute,
                "perf/compute_s_max": float(per_rank.max()), "perf/compute_s_mean": float(per_rank.mean()),
            })  # fmt: skip
        pl_module.record(metrics)
