"""``callbacks.lm_eval`` during training: the scores FSDP on 2 gloo processes logs equal those of
one process, the last ones equal ``plait eval`` of the final checkpoint (the adapter, tested
against lm-eval's own HF model in tests/unit/test_lm_harness.py), and training is unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import EXACT_SGD, compose_config, losses

from strategies.runtime.launch import LAUNCH_ENV
from trainer.build import build_run
from trainer.eval import main as plait_eval
from trainer.rundir import RunDir

EVAL = (
    "callbacks.lm_eval.every_n_steps=2",
    "callbacks.lm_eval.tasks=[plait_corpus,plait_corpus_next_line]",
    "callbacks.lm_eval.limit=3",
)


def _run(tmp_path, name: str, overrides: tuple[str, ...]) -> tuple[dict[int, dict[str, float]], list[float], Path]:
    """(scores by step from ``<run>/eval/step_*.json``, the training losses, the run directory)."""
    cfg = compose_config([*EXACT_SGD, "trainer.max_steps=3", *overrides])
    run_dir = tmp_path / name
    run_dir.mkdir()
    trainer, task, data = build_run(cfg, run_dir, launcher="fork")  # harness.fit, keeping the data module
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    RunDir(run_dir).write_config(cfg, data.tokenizer)  # as the CLI does: plait eval reads them
    scores = {
        json.loads(p.read_text())["step"]: json.loads(p.read_text())["scores"]
        for p in sorted((run_dir / "eval").glob("step_*.json"))
    }
    return scores, losses(task.history), run_dir


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "one", EVAL)


def test_fsdp_on_2_processes_logs_the_scores_of_one_process(one, tmp_path) -> None:
    two, _, _ = _run(tmp_path, "two", (*EVAL, "strategy=fsdp", "trainer.devices=2"))
    assert sorted(one[0]) == sorted(two) == [0, 2, 3]  # before the first step, every 2 steps, after the last
    for step, scores in one[0].items():
        assert set(scores) == set(two[step]) == {
            "plait_corpus/word_perplexity", "plait_corpus/byte_perplexity", "plait_corpus/bits_per_byte",
            "plait_corpus_next_line/acc", "plait_corpus_next_line/acc_norm",
        }  # fmt: skip
        assert two[step] == pytest.approx(scores, rel=1e-5)


def test_the_last_scores_equal_plait_eval_of_the_final_checkpoint(one, tmp_path, capsys) -> None:
    run_dir = one[2]
    (run_dir / "eval" / "step_0000003.json").unlink()
    plait_eval([f"ckpt={run_dir}", "tasks=[plait_corpus,plait_corpus_next_line]", "limit=3"])
    written = json.loads((run_dir / "eval" / "step_0000003.json").read_text())
    assert written["step"] == 3
    assert written["scores"] == pytest.approx(one[0][3], rel=1e-5)


def test_training_is_the_same_with_and_without_the_callback(one, tmp_path) -> None:
    _, without, _ = _run(tmp_path, "off", ())
    assert without == one[1] and len(without) == 3
