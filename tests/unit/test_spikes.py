"""The spike rule (trainer.spikes): hand-computed verdicts, a real run whose skipped steps are the
ones the rule, recomputed here from its metrics.csv, calls spikes, and the guard's choice of the
checkpoint to roll back to."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from harness import compose_config, fit

from strategies.checkpoint.dcp import MANIFEST
from trainer.nonfinite import ADMITTED, NONFINITE, SPIKE, NonFiniteError, NonFiniteGuard
from trainer.rundir import step_dir
from trainer.spikes import SETTLED, SpikeRule, apply_spike_rule

SPIKED = 5  # the optimizer step whose logits the test scales
WINDOW, FACTOR = 3, 10.0


def _rule(values: list[float], recent: list[list[float]], window: int = 4) -> bool:
    rows = torch.zeros(window, 2)
    if recent:
        rows[window - len(recent) :] = torch.tensor(recent)
    return bool(apply_spike_rule(torch.tensor(values), rows, torch.tensor(len(recent)), factor=FACTOR))


def test_the_rule_on_hand_values() -> None:
    recent = [[3.0, 1.0], [2.5, 2.0]]  # the largest loss 3, gradient norms in [1, 2]
    assert not _rule([29.0, 19.0], recent)  # just under 10 x the largest
    assert _rule([31.0, 1.0], recent)  # the loss above 10 x 3
    assert _rule([2.0, 21.0], recent)  # the gradient norm above 10 x 2
    assert _rule([2.0, 0.09], recent)  # the gradient norm below 1 / 10
    assert not _rule([0.01, 0.11], recent)  # a loss may fall any amount
    assert not _rule([1e9, 1e9], [])  # no history: nothing spikes
    # Only the filled rows count: the zeros of an unfilled window are not a gradient norm of 0.
    assert not _rule([2.0, 1.5], [[2.0, 1.0]], window=4)
    # The newest row counts: 15 is above 10 x 1, not above 10 x 20.
    assert not _rule([2.0, 15.0], [[2.0, 1.0], [2.0, 20.0]]) and _rule([2.0, 15.0], [[2.0, 1.0]])


def test_the_window_keeps_the_last_admitted_steps() -> None:
    rule = SpikeRule(FACTOR, window=2)
    yes, no = torch.tensor(True), torch.tensor(False)
    for values, admitted in (([2.0, 1.0], yes), ([2.0, 3.0], yes), ([2.0, 4.0], yes), ([2.0, 50.0], no)):
        rule.observe(torch.tensor(values), admitted)
    assert rule.state_dict()["recent"] == [[2.0, 3.0], [2.0, 4.0]]  # step 1 rolled out, step 4 never in
    assert bool(rule.spikes(torch.tensor([2.0, 0.2]), yes)) and not bool(rule.spikes(torch.tensor([2.0, 0.2]), no))


def test_the_guard_counts_spikes_and_protects_the_step_before_the_anomaly() -> None:
    guard = NonFiniteGuard("skip", max_skipped=5, spikes=SpikeRule(FACTOR, 2), recover_after=2)
    verdicts = [
        guard.verdict(torch.tensor(v), judged=torch.tensor(True)) for v in ([3.0, 1.0], [3.0, 30.0], [math.nan, 1.0])
    ]
    assert [float(v) for v in verdicts] == [ADMITTED, SPIKE, NONFINITE]
    assert guard.admit(6, 3.0, 1.0, ADMITTED) and guard.safe_step() is None
    assert not guard.admit(7, 3.0, 30.0, SPIKE) and guard.safe_step() == 5  # step 7 accuses step 6's weights
    assert not guard.admit(8, math.nan, 1.0, NONFINITE) and guard.safe_step() == 5
    assert guard.admit(9, 3.0, 1.0, ADMITTED) and guard.safe_step() == 5
    assert guard.admit(10, 3.0, 1.0, ADMITTED) and guard.safe_step() is None  # recovered
    assert (guard.skipped, guard.spiked) == (2, 1)


class ScaleLogits(L.Callback):
    """During optimizer step ``SPIKED`` only, the output weight is 30 times larger (a loss and
    gradient spike with finite values); it is restored after that step."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step + 1 == SPIKED:
            self.saved = pl_module.model.output.weight.detach().clone()
            with torch.no_grad():
                pl_module.model.output.weight.mul_(30.0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == SPIKED:
            with torch.no_grad():
                pl_module.model.output.weight.copy_(self.saved)


def _reference_skips(rows: list[dict[str, str]]) -> list[int]:
    """The spike rule written again from metrics.csv's (loss, gradient norm) per step: compared
    with the last ``WINDOW`` steps that were not skipped."""
    admitted: list[tuple[float, float]] = []
    skipped = []
    for row in rows:
        loss, grad_norm = float(row["train/loss"]), float(row["train/grad_norm"])
        recent = admitted[-WINDOW:]
        # Values below SETTLED x the largest admitted so far are settled (never spikes).
        settled = [SETTLED * max(r[k] for r in admitted) for k in (0, 1)] if admitted else [0.0, 0.0]
        spike = bool(recent) and (
            loss > FACTOR * max(settled[0], *(r[0] for r in recent))
            or grad_norm > FACTOR * max(settled[1], *(r[1] for r in recent))
            or (
                grad_norm < min(r[1] for r in recent) / FACTOR
                and loss >= min(r[0] for r in recent) / FACTOR
                and loss > settled[0]
            )
        )
        if spike or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            skipped.append(int(row["step"]))
        else:
            admitted.append((loss, grad_norm))
    return skipped


def test_a_run_skips_the_steps_the_rule_recomputed_from_metrics_csv_calls_spikes(tmp_path: Path) -> None:
    cfg = compose_config([
        "trainer.max_steps=8", "train.nonfinite=skip", f"train.spike_window={WINDOW}", f"train.spike_factor={FACTOR}",
        "logger=csv", "+callbacks.scale._target_=test_spikes.ScaleLogits",
    ])  # fmt: skip
    _, task = fit(cfg, tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train/loss"]]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    expected = _reference_skips(rows)
    assert expected == [SPIKED], rows  # the scaled step, and only it, leaves the recent range
    # plait's count of skipped steps rises exactly at the steps the reference skips.
    counts = [float(r["train/nonfinite_steps"] or 0) for r in rows]
    assert [int(r["step"]) for r, before, now in zip(rows, [0.0, *counts], counts) if now > before] == expected


def test_rollback_names_the_newest_checkpoint_before_the_anomaly_and_stops_after_max_rollbacks(tmp_path: Path) -> None:
    for step in (2, 4, 5, 6):  # step 6 unfinished (no manifest): never a checkpoint to load
        step_dir(tmp_path, step).mkdir()
        if step != 6:
            (step_dir(tmp_path, step) / MANIFEST).write_text("{}")
    guard = NonFiniteGuard("rollback", max_consecutive=2, max_rollbacks=1, spikes=SpikeRule(FACTOR, 2))
    assert guard.admit(5, 3.0, 1.0, ADMITTED)
    assert not guard.admit(7, 3.0, 0.0, SPIKE) and guard.rollback_due is None  # one in a row: only skipped
    assert not guard.admit(8, math.nan, 1.0, NONFINITE, checkpoints=tmp_path)
    assert guard.rollback_due == step_dir(tmp_path, 5)  # step 7 accuses step 6's weights: step 5 and older
    guard.rolled_back()
    assert (guard.rollbacks, guard.consecutive, guard.rollback_due, guard.safe_step()) == (1, 0, None, 5)
    assert not guard.admit(9, math.nan, 1.0, NONFINITE, checkpoints=tmp_path)
    with pytest.raises(NonFiniteError, match=r"after 1 rollback\(s\).*continue from step_0000005"):
        guard.admit(10, math.nan, 1.0, NONFINITE, checkpoints=tmp_path)


def test_values_settled_far_below_the_runs_scale_do_not_spike() -> None:
    # DPO's saturated end (bench/dpo.py at step ~1476): loss 5e-10 and gradient norm 4e-8 after a
    # start at (0.69, 2.0); ratios between such numbers are noise, not divergence.
    recent = [[1e-10, 3e-9], [2e-10, 2e-9]]
    scale = torch.tensor([0.69, 2.0])
    rows = torch.zeros(4, 2)
    rows[2:] = torch.tensor(recent)

    def rule(values: list[float]) -> bool:
        return bool(apply_spike_rule(torch.tensor(values), rows, torch.tensor(2), factor=FACTOR, scale=scale))

    assert not rule([5e-10, 3.6e-8])  # 2.5x and 12x the recent largest, far below the run's scale
    assert not rule([1e-11, 1e-10])  # the gradient falls with the loss: convergence, not collapse
    assert rule([0.69 * SETTLED * FACTOR * 1.1, 1e-9])  # above f x SETTLED x the scale: a spike
    # lr=1e6 on nano: the gradient norm collapses while the loss stays at ln(4096).
    assert _rule([8.31777, 0.0], [[8.3259, 0.68]])


def test_the_scale_is_the_largest_admitted_step_and_survives_a_checkpoint() -> None:
    rule = SpikeRule(FACTOR, window=2)
    yes, no = torch.tensor(True), torch.tensor(False)
    for values, admitted in (([3.0, 2.0], yes), ([1.0, 5.0], yes), ([0.5, 0.25], yes), ([9.0, 90.0], no)):
        rule.observe(torch.tensor(values), admitted)
    state = rule.state_dict()
    assert state["scale"] == [3.0, 5.0] and state["recent"] == [[1.0, 5.0], [0.5, 0.25]]
    again = SpikeRule(FACTOR, window=2)
    again.load_state_dict(state)
    assert again.state_dict() == state
    old = SpikeRule(FACTOR, window=2)
    old.load_state_dict({"recent": [[1.0, 5.0], [0.5, 0.25]]})  # written before the scale was kept
    assert old.state_dict()["scale"] == [1.0, 5.0]
