"""Values only the loggers read are logged on Lightning's logging steps, and every logged row has them."""

from __future__ import annotations

import csv
from types import SimpleNamespace

from harness import compose_config, fit
from trainer.loggers import is_logging_step


def test_is_logging_step_follows_log_every_n_steps() -> None:
    def trainer(step: int, every: int = 3, stop: bool = False) -> SimpleNamespace:
        return SimpleNamespace(global_step=step, log_every_n_steps=every, should_stop=stop)

    assert [s for s in range(1, 10) if is_logging_step(trainer(s))] == [3, 6, 9]
    assert is_logging_step(trainer(4, stop=True))  # Lightning also writes when the run stops
    assert not any(is_logging_step(trainer(s, every=0)) for s in range(1, 5))  # logging off


def test_every_logged_row_holds_every_train_key(tmp_path) -> None:
    cfg = compose_config(["logger=csv", "trainer.log_every_n_steps=2", "trainer.max_steps=5"])
    fit(cfg, tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train/loss"]]
    assert [int(row["step"]) for row in rows] == [1, 3]  # optimizer steps 2 and 4 (Lightning counts from 0)
    keys = ("train/grad_norm", "train/lr", "train/supervised_tokens", "train/tokens_seen")
    keys += ("perf/tokens_per_s", "perf/tflops")
    assert all(row[key] for row in rows for key in keys)
