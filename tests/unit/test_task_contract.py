"""The Task's side of its contracts (trainer.protocols): one `pop_sums` hook reduced and divided
by its counts, and a `configure_model` that parallelizes once however often Lightning calls it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainer.objectives.pretrain import CausalLM
from trainer.protocols import Objective
from trainer.step_metrics import read_means
from trainer.task import Task


class _Sums(CausalLM):
    def __init__(self, sums: torch.Tensor) -> None:
        super().__init__()
        self.sums = sums

    def pop_sums(self):
        return ["loss/a", "loss/b", "rewards/margin"], self.sums


def _task(objective: Objective, calls: list[str]) -> Task:
    task = Task(
        model=torch.nn.Linear(2, 2),
        objective=objective,
        optimizer=torch.optim.SGD,
        scheduler=None,
        micro_batch_size=1,
        max_grad_norm=None,
        weight_decay=0.0,
        no_decay=(),
        eval_every=0,
        flops_per_token=0.0,
    )
    strategy = SimpleNamespace(
        parallelize=lambda model: calls.append("parallelize"),
        all_reduce_sum=lambda tensor, axis: calls.append(axis) or tensor * 2,  # as if two ranks held the same sums
        dims=SimpleNamespace(pp=1),
    )
    task._trainer = SimpleNamespace(strategy=strategy)
    return task


def test_pop_means_are_reduced_once_and_divided_by_their_counts() -> None:
    calls: list[str] = []
    task = _task(_Sums(torch.tensor([[3.0, 5.0, 1.0], [2.0, 0.0, 4.0]])), calls)
    assert read_means(task.pop_means("val")) == {
        "val/loss/a": 1.5,
        "val/rewards/margin": 0.25,
    }  # a count of 0 logs nothing
    assert calls == ["dp_cp"]


def test_an_objective_without_sums_logs_nothing() -> None:
    calls: list[str] = []
    assert _task(CausalLM(), calls).pop_means("train") == [] and calls == []


def test_configure_model_parallelizes_once() -> None:
    calls: list[str] = []
    task = _task(CausalLM(), calls)
    task.configure_model()
    task.configure_model()  # Lightning calls the hook again at a later fit/validate/test
    assert calls == ["parallelize"]


def test_the_progress_bar_s_val_loss_leaves_the_pending_steps_on_the_device() -> None:
    task = _task(CausalLM(), [])
    task.history = [{"step": 0, "val_loss": 2.0}]
    task._pending.add({"step": 1, "loss": torch.tensor(1.5), "_tokens_seen": 512})
    assert task.latest_val_loss == 2.0 and len(task._pending) == 1  # read at every redraw: no host sync
    assert task.history[-1] == {"step": 1, "loss": 1.5} and len(task._pending) == 0


def test_every_declared_headline_metric_is_one_the_objective_logs() -> None:
    """summary.json takes ``val/<name>`` for each name an objective declares: a name it never logs
    (a typo, a renamed metric) would leave the run's measure of learning out without a word."""
    from trainer.objectives.kto import KTO
    from trainer.objectives.preference import DPO, IPO, ORPO, SimPO

    for objective in (DPO(), IPO(), SimPO(), ORPO(), KTO()):
        names, _ = objective.pop_sums()
        assert objective.headline_metrics and set(objective.headline_metrics) <= set(names), type(objective).__name__
    task = _task(DPO(), [])
    task._trainer.datamodule = SimpleNamespace(
        evaluators=lambda: [SimpleNamespace(headline_metrics=["val/exact_match/a"])]
    )
    assert task.headline_metrics() == ["val/rewards/accuracy", "val/rewards/margin", "val/exact_match/a"]
