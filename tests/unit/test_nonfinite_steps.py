"""A non-finite step is skipped exactly (the parameters equal a plain loop that consumes that
batch without applying it), the run goes on or stops by ``train.nonfinite``, and a step's
metrics row is on disk before its checkpoint exists."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from harness import EXACT_SGD, compose_config, fit, reference_setup

from trainer.callbacks.checkpoint import PeriodicCheckpoint
from trainer.nonfinite import ADMITTED, NONFINITE, NonFiniteError, NonFiniteGuard

POISONED = 2  # the optimizer step whose loss is NaN
STEPS = 3
IGNORE_INDEX = -100


class Poison(L.Callback):
    """During optimizer step ``POISONED`` only, one output weight is NaN (so are its loss and
    gradients); the weight is restored after that step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step + 1 == POISONED:
            weight = pl_module.model.output.weight
            self.saved = weight.detach().clone()
            with torch.no_grad():
                weight[0, 0] = math.nan

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == POISONED:
            with torch.no_grad():
                pl_module.model.output.weight.copy_(self.saved)


class ProbeCheckpoint(PeriodicCheckpoint):
    """Records, at each save, whether metrics.csv already holds the row of the step saved."""

    def save(self, trainer: L.Trainer) -> Path:
        with open(Path(trainer.default_root_dir) / "metrics.csv", newline="") as file:
            steps = {int(row["step"]) for row in csv.DictReader(file)}
        trainer.lightning_module.history.append(
            {"probe": trainer.global_step, "row_written": trainer.global_step in steps}
        )
        return super().save(trainer)


def _reference(cfg: Any) -> dict[str, torch.Tensor]:
    """Plain PyTorch: SGD steps 1 and 3; step 2's batch is drawn but its update is not applied."""
    rows, model, optimizer, sampler = reference_setup(cfg)
    for step, index in zip(range(1, STEPS + 1), sampler):
        if step == POISONED:
            continue
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        labels = rows.labels[index]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss / (labels != IGNORE_INDEX).sum()).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_non_finite_step_is_skipped_and_its_row_precedes_its_checkpoint(tmp_path: Path) -> None:
    cfg = compose_config([
        *EXACT_SGD, f"trainer.max_steps={STEPS}", "train.micro_batch_size=8", "train.nonfinite=skip",
        "logger=csv", "callbacks.checkpoint._target_=test_nonfinite_steps.ProbeCheckpoint",
        "callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep_last=1",
        "+callbacks.poison._target_=test_nonfinite_steps.Poison", "+callbacks.params._target_=harness.ParamRecorder",
    ])  # fmt: skip
    _, task = fit(cfg, tmp_path)
    losses = [h["loss"] for h in task.history if "loss" in h]
    assert math.isnan(losses[POISONED - 1]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != POISONED - 1)
    params = next(h["params"] for h in task.history if "params" in h)
    torch.testing.assert_close(params, _reference(cfg), rtol=1e-5, atol=1e-6)
    probes = [h for h in task.history if "probe" in h]
    assert [p["probe"] for p in probes] == [1, 2, 3] and all(p["row_written"] for p in probes), probes
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [r["train/nonfinite_steps"] for r in rows if r["step"] == str(STEPS)] == ["1.0"]


def test_guard_stops_after_max_consecutive_non_finite_steps() -> None:
    guard = NonFiniteGuard("stop", max_consecutive=2)
    assert guard.admit(1, 2.0, 1.0, ADMITTED)
    assert not guard.admit(2, math.nan, 1.0, NONFINITE)
    assert guard.admit(3, 2.0, 1.0, ADMITTED)  # a finite step resets the count
    assert not guard.admit(4, 2.0, math.inf, NONFINITE)
    with pytest.raises(NonFiniteError, match="step 5.*train.nonfinite=skip"):
        guard.admit(5, math.inf, math.nan, NONFINITE)
    assert (guard.consecutive, guard.skipped) == (2, 3)
    skipping = NonFiniteGuard("skip", max_consecutive=1, max_skipped=8)
    assert not any(skipping.admit(step, math.nan, math.nan, NONFINITE) for step in range(1, 9))
    with pytest.raises(NonFiniteError, match="step 9: 9 steps skipped.*train.max_skipped_steps=8"):
        skipping.admit(9, math.nan, math.nan, NONFINITE)
    with pytest.raises(ValueError, match="train.nonfinite='never'"):
        NonFiniteGuard("never")  # type: ignore[arg-type]
