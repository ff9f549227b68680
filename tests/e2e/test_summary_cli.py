"""What ends a run and whether it learns, from the CLI: an SFT source that runs out before
``trainer.max_steps`` is named at launch and in ``summary.json``, and so are a non-finite step and
a stop signal; a DPO run's ``summary.json`` and ``plait compare`` show its held-out reward accuracy
and margin, an SFT run's its exact match.

The references are the runs' own ``metrics.csv`` (the steps trained, each evaluation's metrics),
read here, not through the summary code, and the steps at which the test's callbacks stop a run."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from harness import CLI_TINY, env_with_tests, plait

MAX_STEPS = 20
BASE = [o for o in CLI_TINY if not o.startswith(("trainer.max_steps=", "data.eval_rows="))] + [
    f"trainer.max_steps={MAX_STEPS}"
]


STOP_AT = 2  # the optimizer step at which the test's callbacks stop a run


class PoisonFromStep(L.Callback):
    """From optimizer step ``STOP_AT`` on, one output weight is NaN (so are the loss and gradients)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step + 1 == STOP_AT:
            with torch.no_grad():
                pl_module.model.output.weight[0, 0] = math.nan


class SignalSelf(L.Callback):
    """SIGTERM to this process at the start of optimizer step ``STOP_AT``."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step + 1 == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def _evaluations(run_dir: Path, key: str) -> list[float]:
    """``key`` of every metrics.csv row that has it, in step order."""
    return [float(r[key]) for r in sorted(_rows(run_dir), key=lambda r: int(r["step"])) if r.get(key)]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``plait sft`` on one own source of 40 conversations (one epoch: a few steps) with
    ``trainer.max_steps=20``: (run directory, stderr)."""
    root = tmp_path_factory.mktemp("sft_own")
    chats = root / "chats.jsonl"
    with open(chats, "w") as file:
        for i in range(40):
            messages = [{"role": "user", "content": f"say {i} twice"}, {"role": "assistant", "content": f"{i} {i}"}]
            file.write(json.dumps({"messages": messages}) + "\n")
    run_dir = root / "run"
    sources = f"data.sources={{mine: {{source: {chats}, val_size: 8, metric: exact_match}}}}"
    result = _ok(plait("sft", *BASE, sources, "train.global_batch_size=4", f"run_dir={run_dir}"))
    return run_dir, result.stderr


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 DPO steps on the synthetic copy pairs, evaluated at steps 0, 2 and 4."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    _ok(
        plait(
            "dpo",
            *BASE,
            "data=preference_synthetic",
            "data.seq_len=64",
            "data.sources.copy.limit=64",
            "data.sources.copy.val_size=16",
            "trainer.max_steps=4",
            "train.eval_every=2",
            f"run_dir={run_dir}",
        )
    )
    return run_dir


def test_a_source_spent_before_max_steps_is_named_at_launch_and_in_the_summary(sft_run: tuple[Path, str]) -> None:
    run_dir, stderr = sft_run
    trained = sorted({int(r["step"]) for r in _rows(run_dir) if r.get("train/loss")})
    assert trained == list(range(1, len(trained) + 1)) and len(trained) < MAX_STEPS, trained
    steps = len(trained)
    expected = (
        f"plait: the run ends after {steps} of trainer.max_steps={MAX_STEPS} steps: data.sources.mine is spent after "
        f"max_epochs=1.0 ({steps} steps); raise +data.sources.mine.max_epochs"  # +: the mapping does not set it
    )
    lines = stderr.splitlines()
    assert expected in lines, stderr[-3000:]
    assert lines.index(expected) == next(i for i, line in enumerate(lines) if line.startswith("plait: data: ")) + 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["planned_steps"], summary["max_steps"]) == (steps, steps, MAX_STEPS)
    assert summary["stopped_by"] == "data_exhausted"
    assert summary["stop_reason"] == expected.split(" steps: ", 1)[1]
    # Where an exact-match evaluator runs, its score is the run's measure of learning.
    matches = _evaluations(run_dir, "val/exact_match/mine")
    assert summary["first_val_metrics"] == {"val/exact_match/mine": matches[0]}
    assert summary["final_val_metrics"] == {"val/exact_match/mine": matches[-1]}


def test_a_dpo_summary_has_the_held_out_reward_accuracy_and_margin(dpo_run: Path) -> None:
    summary = json.loads((dpo_run / "summary.json").read_text())
    assert (summary["steps"], summary["planned_steps"], summary["max_steps"]) == (4, 4, 4)
    assert (summary["stopped_by"], summary["stop_reason"]) == ("max_steps", None)
    for name in ("val/rewards/accuracy", "val/rewards/margin"):
        values = _evaluations(dpo_run, name)
        assert len(values) == 3, values  # steps 0, 2 and 4
        assert summary["first_val_metrics"][name] == values[0]
        assert summary["final_val_metrics"][name] == values[-1]


def _table(stdout: str) -> dict[str, dict[str, str]]:
    """``plait compare``'s table: run name -> {column title: cell}, columns cut where the rule's dashes are."""
    header, rule, *rows = stdout.splitlines()
    spans, at = [], 0
    for dashes in rule.split("  "):
        spans.append((at, at + len(dashes)))
        at += len(dashes) + 2
    cells = [[line[a:b].strip() for a, b in spans] for line in [header, *rows] if not line.startswith("plait: ")]
    return {row[0]: dict(zip(cells[0], row)) for row in cells[1:]}


def test_compare_shows_each_runs_own_measure(dpo_run: Path, sft_run: tuple[Path, str], tmp_path: Path) -> None:
    result = _ok(plait("compare", str(dpo_run), str(sft_run[0]), f"out={tmp_path / 'c.png'}", timeout=120))
    table = _table(result.stdout)
    dpo, sft = (table[f"{run.parent.name}/{run.name}"] for run in (dpo_run, sft_run[0]))
    assert (dpo["stopped by"], sft["stopped by"]) == ("max_steps", "data_exhausted")
    for name in ("rewards/accuracy", "rewards/margin"):
        assert float(dpo[name]) == pytest.approx(_evaluations(dpo_run, f"val/{name}")[-1], rel=1e-3, abs=1e-9)
        assert sft[name] == "-"
    assert float(sft["exact_match/mine"]) == _evaluations(sft_run[0], "val/exact_match/mine")[-1]
    assert dpo["exact_match/mine"] == "-"


def _stopped_run(
    tmp_path: Path, callback: str, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = env_with_tests()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    args = [*BASE, "trainer.max_steps=6", "logger=none", "~callbacks.plots"]
    args.append(f"+callbacks.stop._target_=test_summary_cli.{callback}")
    result = plait("pretrain", *args, *overrides, f"run_dir={tmp_path}", env=env)
    return result, json.loads((tmp_path / "summary.json").read_text())


def test_a_non_finite_stop_is_in_the_summary(tmp_path: Path) -> None:
    result, summary = _stopped_run(tmp_path, "PoisonFromStep", "train.max_nonfinite_steps=1")
    assert result.returncode == 3, result.stderr[-3000:]
    assert (summary["stopped_by"], summary["steps"], summary["max_steps"]) == ("nonfinite", STOP_AT, 6)
    assert summary["stop_reason"] in result.stderr and f"training stopped at step {STOP_AT}" in summary["stop_reason"]


def test_a_stop_signal_is_in_the_summary(tmp_path: Path) -> None:
    result, summary = _stopped_run(tmp_path, "SignalSelf")
    assert result.returncode == 143, result.stderr[-3000:]
    assert (summary["stopped_by"], summary["steps"]) == ("signal", STOP_AT)
    assert summary["stop_reason"] == f"SIGTERM received: stopped after step {STOP_AT}; continue with resume=last"


# Slow: CLI runs or waits on timeouts (10-30 s for the file); left out of the default run to keep it
# near 15 min on 2 cores since it runs tests/dist/ (python -m pytest -m slow runs them).
pytestmark = pytest.mark.slow
