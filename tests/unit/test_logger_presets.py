"""Every logger option writes metrics.csv (which ``plait compare`` reads) besides its own files;
``logger=none`` is the one option that turns every logger off."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from harness import TINY, compose_config, fit

from trainer.build import build_loggers
from trainer.catalog import config_groups
from trainer.loggers import RunCSVLogger

WITH_CSV = [option for option in config_groups()["logger"] if option != "none"]


@pytest.mark.parametrize("option", WITH_CSV)
def test_every_logger_option_builds_the_csv_logger(option: str, tmp_path: Path) -> None:
    """Before: logger=tensorboard replaced the csv logger, and plait compare lost the run."""
    if option == "wandb":
        pytest.importorskip("wandb")
    loggers = build_loggers(compose_config([f"logger={option}"]), tmp_path)
    assert [type(lg) for lg in loggers if isinstance(lg, RunCSVLogger)] == [RunCSVLogger], loggers


def test_logger_none_builds_no_logger(tmp_path: Path) -> None:
    assert build_loggers(compose_config(["logger=none"]), tmp_path) == []


def test_a_tensorboard_run_writes_metrics_csv_and_its_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    overrides = [o for o in TINY if o not in ("logger=none", "trainer.max_steps=3")]
    cfg = compose_config([*overrides, "logger=tensorboard", "trainer.max_steps=2"], tiny=False)
    fit(cfg, tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as file:
        steps = sorted({int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")})
    assert steps == [1, 2], steps
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
