"""``plait eval`` from the command line on a run the CLI trained with ``callbacks.lm_eval`` on:
the callback's rows in metrics.csv, the scores of the final checkpoint equal to the callback's last,
``plait compare`` showing them (slow: two subprocesses)."""

from __future__ import annotations

import csv
import json

import pytest
from harness import CLI_TINY, plait

pytestmark = pytest.mark.slow
TASKS = "tasks=[plait_corpus_next_line]"


def test_plait_eval_scores_a_cli_run_as_its_callback_did(tmp_path) -> None:
    run = tmp_path / "run"
    trained = plait(
        "pretrain", *CLI_TINY, "callbacks.lm_eval.every_n_steps=2", f"callbacks.lm_eval.{TASKS}",
        "callbacks.lm_eval.limit=4", f"run_dir={run}",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/plait_corpus_next_line/acc")]
    assert [int(float(r["step"])) for r in rows] == [0, 2, 4]
    callback = json.loads((run / "eval" / "step_0000004.json").read_text())["scores"]
    (run / "eval" / "step_0000004.json").unlink()
    scored = plait("eval", f"ckpt={run}", TASKS, "limit=4")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "plait_corpus_next_line" in scored.stdout
    assert json.loads((run / "eval" / "step_0000004.json").read_text())["scores"] == pytest.approx(callback, rel=1e-6)
    compared = plait("compare", str(run), f"out={tmp_path / 'c.png'}")
    assert "plait_corpus_next_line/acc" in compared.stdout.splitlines()[0]
