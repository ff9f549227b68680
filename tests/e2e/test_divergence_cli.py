"""A diverging run from the CLI (``optim.lr=1e6`` on the nano model): it stops at the first
anomalous step, before the weights of a second bad update are kept, its advice trains, the
checkpoint the advice names survives pruning, and ``train.nonfinite=skip`` says what it skipped.

The references are the runs' own ``metrics.csv`` (the spike rule recomputed from the logged loss and
gradient norm of each step) and the checkpoints on disk, read here, not through plait's code."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import CLI_TINY, plait

BASE = [*CLI_TINY, "logger=csv", "~callbacks.plots", "trainer.max_steps=10"]
FACTOR = 10.0  # train.spike_factor's default


def _run(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    run_dir = Path(next(a for a in args if a.startswith("run_dir=")).split("=", 1)[1])
    result = plait("pretrain", *BASE, *args, cwd=run_dir.parent)  # plait takes the current folder off sys.path
    summary = run_dir / "summary.json"
    return result, json.loads(summary.read_text()) if summary.exists() else {}


def _train_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return {int(r["step"]): r for r in csv.DictReader(file) if r.get("train/loss")}


def _first_spike(rows: dict[int, dict[str, str]], since: int = 1) -> int:
    """The first step from ``since`` on whose gradient norm leaves [min / 10, 10 x max] of the steps
    before it, or whose loss is above 10 x their largest (the spike rule, from metrics.csv)."""
    steps = sorted(s for s in rows if s >= since)
    for i, step in enumerate(steps[1:], start=1):
        losses = [float(rows[s]["train/loss"]) for s in steps[:i]]
        norms = [float(rows[s]["train/grad_norm"]) for s in steps[:i]]
        loss, norm = float(rows[step]["train/loss"]), float(rows[step]["train/grad_norm"])
        # (The rule's floor, 0.1 x the run's largest, does not bind on these steps' values.)
        if (
            loss > FACTOR * max(losses)
            or norm > FACTOR * max(norms)
            or (norm < min(norms) / FACTOR and loss >= min(losses) / FACTOR)
        ):
            return step
    raise AssertionError(f"no spike in {rows}")


def _error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 3, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    return next(line for line in result.stderr.splitlines() if line.startswith("plait: error: training stopped"))


@pytest.mark.slow  # the rule and the guard: tests/unit/test_spikes.py, fast
def test_lr_1e6_stops_at_the_first_spike_and_a_new_run_with_a_lower_lr_trains(tmp_path: Path) -> None:
    result, summary = _run("optim.lr=1e6", f"run_dir={tmp_path / 'diverged'}")
    error = _error(result)
    rows = _train_rows(tmp_path / "diverged")
    first = _first_spike(rows)
    assert all(math.isfinite(float(r["train/loss"])) for r in rows.values())  # it stopped before any NaN
    # Three anomalous steps in a row (train.max_nonfinite_steps=3) from the first spike on.
    assert (
        f"stopped at step {first + 2}: 3 anomalous step(s) in a row" in error and f"the first, step {first}," in error
    )
    assert summary["stopped_by"] == "nonfinite" and summary["skipped_steps"] == 3 and summary["steps"] == first + 2
    # The first spike accuses the weights of the step before it; no checkpoint precedes those.
    assert first == 2 and "no checkpoint precedes them: start a new run with a lower optim.lr" in error
    result, summary = _run("optim.lr=1e-3", "trainer.max_steps=4", f"run_dir={tmp_path / 'again'}")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(r["train/loss"]) for _, r in sorted(_train_rows(tmp_path / "again").items())]
    assert summary["skipped_steps"] == 0 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_the_checkpoint_before_a_divergence_survives_pruning_and_the_advised_resume_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = ["callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep_last=2"]
    result, _ = _run(*ckpt, "trainer.max_steps=3", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    # The same run continues with a ruinous learning rate.
    result, summary = _run(*ckpt, "resume=last", "resume_override=[optim.lr]", "optim.lr=1e6", f"run_dir={run_dir}")
    error = _error(result)
    first = _first_spike(_train_rows(run_dir), since=3)
    assert first == 5 and summary["steps"] == first + 2, error  # step 4's update ruined the weights
    # keep_last=2 alone would keep only steps 5 and 6 (saved from ruined weights); step 3 stays.
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_0000003", "step_0000005", "step_0000006"], kept
    command = r"continue from step_0000003, .*?: (run_dir=\S+ resume=\S+ resume_override=\[optim.lr\]) optim.lr=<lower>"
    advised = re.search(command, error)
    assert advised is not None, error
    result, summary = _run(*shlex.split(advised.group(1)), "optim.lr=1e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _train_rows(run_dir)  # the resumed steps 4..10 replace the diverged ones
    losses = [float(rows[s]["train/loss"]) for s in range(4, 11)]
    assert summary["skipped_steps"] == 0 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


@pytest.mark.slow  # the count and the limit: tests/unit/test_nonfinite_steps.py, fast
def test_skip_says_what_it_skipped_and_stops_past_its_limit(tmp_path: Path) -> None:
    result, summary = _run(
        "optim.lr=1e6", "train.nonfinite=skip", "train.max_skipped_steps=20", f"run_dir={tmp_path / 'a'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _train_rows(tmp_path / "a")
    skipped = int(float(rows[10]["train/nonfinite_steps"]))
    assert skipped == 10 - _first_spike(rows) + 1 == summary["skipped_steps"]  # every step from the first spike on
    assert f"plait: warning: {skipped} of 10 steps skipped their update" in result.stderr
    result, summary = _run(
        "optim.lr=1e6", "train.nonfinite=skip", "train.max_skipped_steps=3", f"run_dir={tmp_path / 'b'}"
    )
    error = _error(result)
    assert "stopped at step 5: 4 steps skipped" in error and "more than train.max_skipped_steps=3" in error
    assert (summary["stopped_by"], summary["skipped_steps"]) == ("nonfinite", 4)


@pytest.mark.slow
def test_rollback_reloads_the_checkpoint_before_the_divergence_and_stops_when_it_recurs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = ["callbacks.checkpoint.every_n_steps=1", "callbacks.checkpoint.keep_last=2"]
    result, _ = _run(*ckpt, "trainer.max_steps=3", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    rollback = ("train.nonfinite=rollback", "train.max_rollbacks=2", "trainer.max_steps=20")
    result, summary = _run(
        *ckpt, *rollback, "resume=last", "resume_override=[optim.lr]", "optim.lr=1e6", f"run_dir={run_dir}"
    )
    error = _error(result)
    rows = _train_rows(run_dir)
    first = _first_spike(rows, since=3)
    back = [int(s) for s in re.findall(r"rolled back at step (\d+) to step_0000003", result.stderr)]
    assert first == 5 and back[0] == first + 2 and len(back) == 2 == summary["rollbacks"], result.stderr[-3000:]
    # The step after a rollback trains from step 3's weights: a live gradient again (the ruined
    # weights give 0 or NaN), admitted by the rule recomputed from the steps before the anomaly.
    after = rows[back[0] + 1]
    norms = [float(rows[s]["train/grad_norm"]) for s in (1, 2, 3, 4)]
    assert min(norms) / FACTOR <= float(after["train/grad_norm"]) <= FACTOR * max(norms), after
    # The learning rate stays the run's (1e6 ruins it again): the third time it stops, naming step 3.
    assert (
        summary["stopped_by"] == "nonfinite"
        and "after 2 rollback(s)" in error
        and "continue from step_0000003" in error
    )
    assert "step_0000003" in {p.name for p in (run_dir / "checkpoints").glob("step_*")}


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_step_that_stops_the_run_ends_metrics_csv_and_the_summary(tmp_path: Path, fused: str) -> None:
    """The stopping step's row was missing from metrics.csv, and summary.json's steps was 4 with the
    fused optimizer (a verdict on the device) and 3 without (a host verdict stops before Lightning
    counts the step), for the same run (a reviewer's)."""
    run_dir = tmp_path / "run"
    result, summary = _run(
        "optim.lr=30", "train.max_grad_norm=0", "scheduler.warmup_steps=0", "trainer.log_every_n_steps=1",
        f"optim.fused={fused}", f"run_dir={run_dir}",
    )  # fmt: skip
    stopped = int(re.search(r"stopped at step (\d+)", _error(result)).group(1))
    rows = _train_rows(run_dir)
    assert max(rows) == stopped == summary["steps"], (sorted(rows), stopped, summary["steps"])
    assert float(rows[stopped]["train/nonfinite_steps"]) == summary["skipped_steps"] == 3
    assert float(rows[stopped]["train/loss"]) == pytest.approx(summary["final_train_loss"])
    # The tokens of exactly those steps (the fused path reads its verdict after more steps ran).
    assert summary["tokens_seen"] == stopped * float(rows[1]["train/tokens_seen"])


def test_a_run_stopped_at_its_first_step_keeps_its_run_directory(tmp_path: Path) -> None:
    """A divergence stop is a result, even at step 1: its host verdict comes before Lightning counts
    the step, and the failed-first-step cleanup removed the run with its summary (a reviewer's)."""
    run_dir = tmp_path / "run"
    result, summary = _run(
        "+model.init_std=1e30", "train.max_nonfinite_steps=1", "optim.fused=false", f"run_dir={run_dir}"
    )
    assert "stopped at step 1:" in _error(result) and "is removed" not in result.stderr
    assert summary["steps"] == 1 and summary["stopped_by"] == "nonfinite"
