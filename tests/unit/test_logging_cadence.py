"""Values only the loggers read are logged on Lightning's logging steps, and every logged row has them."""

from __future__ import annotations

import csv
from types import SimpleNamespace

from harness import compose_config, fit

from trainer.loggers import is_logging_step


def test_is_logging_step_follows_log_every_n_steps() -> None:
    def trainer(step: int, every: int = 3, max_steps: int = 10) -> SimpleNamespace:
        return SimpleNamespace(global_step=step, log_every_n_steps=every, max_steps=max_steps)

    assert [s for s in range(1, 11) if is_logging_step(trainer(s))] == [3, 6, 9, 10]  # and the last step
    assert [s for s in range(1, 5) if is_logging_step(trainer(s, every=0, max_steps=4))] == [4]


def test_every_logged_row_holds_every_train_key(tmp_path) -> None:
    cfg = compose_config(["logger=csv", "trainer.log_every_n_steps=2", "trainer.max_steps=5"])
    fit(cfg, tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train/loss"]]
    assert [int(row["step"]) for row in rows] == [2, 4, 5]  # row k = optimizer step k, and the last step
    keys = ("train/grad_norm", "train/lr", "train/supervised_tokens", "train/tokens_seen")
    keys += ("perf/tokens_per_s", "perf/tflops", "epoch")
    assert all(row[key] for row in rows for key in keys)
    with open(tmp_path / "metrics.csv", newline="") as file:
        val = [(int(row["step"]), row["train/loss"]) for row in csv.DictReader(file) if row["val/loss"]]
    assert val == [(0, ""), (5, rows[-1]["train/loss"])]  # before training, and after step 5 in step 5's row
