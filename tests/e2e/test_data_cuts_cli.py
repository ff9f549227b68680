"""The launch of a run whose data lose prompt tokens says so (which source, which setting), logs the
counts in row 0 of metrics.csv and writes them to summary.json; a source with nothing left to
train on is refused before the run directory exists."""

from __future__ import annotations

import csv
import json

import pytest
from harness import plait

from trainer.rundir import RunDir

SMALL = (
    "model=nano",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "trainer.enable_progress_bar=false",
    "~callbacks.plots",
)


def test_dpo_with_cut_prompts_warns_and_records_the_counts(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = plait(
        "dpo",
        *SMALL,
        "data=preference_synthetic",
        "data.seq_len=32",
        "data.max_prompt_len=4",
        "data.sources.copy.limit=64",
        "data.sources.copy.val_size=8",
        "trainer.max_steps=1",
        f"run_dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("plait: warning: data.sources.copy:")]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert "64 of 64 training pairs (100.0%) lose supervised or prompt tokens" in warnings[0]
    assert "raise data.seq_len (now 32;" in warnings[0] and "change data.max_prompt_len (now 4:" in warnings[0]
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["data"]["copy"]["samples"] == 64 and summary["data"]["copy"]["prompts_cut"] == 64
    assert (
        summary["data"]["copy"]["held_out"]["samples"] == 8 and summary["data"]["copy"]["held_out"]["prompts_cut"] == 8
    )
    assert (
        "plait: data cuts (held-out, scored as cut): data.sources.copy: 8 pairs: 8 with the prompt cut" in result.stderr
    )
    with open(RunDir(run_dir).metrics, newline="") as file:
        row0 = next(r for r in csv.DictReader(file) if r["step"] == "0")
    assert float(row0["data/prompts_cut/copy"]) == 64.0


def test_a_source_that_keeps_no_supervised_token_ends_the_launch_with_one_line(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = plait("sft", *SMALL, "data.long_samples=drop", "data.seq_len=64", f"run_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1 and "keeps a supervised token" in errors[0] and "data.long_samples=split" in errors[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_budget_search_with_nothing_to_train_on_is_refused_before_its_first_roll_out(tmp_path) -> None:
    # The search forks roll-outs that prepare the data themselves; the launcher prepares it first.
    run_dir = tmp_path / "run"
    result = plait("sft", *SMALL, "budget=msft", "data.long_samples=drop", "data.seq_len=64", f"run_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1 and "keeps a supervised token" in errors[0], result.stderr[-3000:]
    assert not run_dir.exists()


# Slow: CLI runs or waits on timeouts (10-30 s for the file); left out of the default run to keep it
# near 15 min on 2 cores since it runs tests/dist/ (python -m pytest -m slow runs them).
pytestmark = pytest.mark.slow
