"""A metrics.csv whose tail a power cut damaged (NUL bytes, a partial row) is repaired when a
continuing run opens it: the damaged lines are dropped and said, the complete rows kept byte for byte."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from trainer.loggers import RunCSVLogger, repair_metrics


def _killed_run(run_dir: Path, steps: int = 6) -> bytes:
    """A run's metrics.csv with rows of steps 0..steps-1 (as a killed run leaves it); its bytes."""
    logger = RunCSVLogger(str(run_dir))
    for step in range(steps):
        logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        logger.save()
    return (run_dir / "metrics.csv").read_bytes()


@pytest.mark.parametrize(
    "tail, what",
    [
        (b"\0" * 37, "NUL bytes"),  # the file's size reached the disk, its data did not
        (b"6,0.1428", "partial or malformed rows"),  # a row cut in the middle, no newline
        (b"6\r\n", "partial or malformed rows"),  # a row with its loss missing
    ],
)
def test_a_damaged_tail_is_dropped_and_said(tmp_path: Path, tail: bytes, what: str) -> None:
    intact = _killed_run(tmp_path)
    (tmp_path / "metrics.csv").write_bytes(intact + tail)
    line = repair_metrics(str(tmp_path / "metrics.csv"))
    assert line is not None and f"dropped 1 damaged line(s) of {len(tail)} bytes ({what}" in line, line
    assert "after the row of step 5" in line
    assert (tmp_path / "metrics.csv").read_bytes() == intact
    assert repair_metrics(str(tmp_path / "metrics.csv")) is None  # intact now: nothing to say


def test_the_continuing_run_logs_after_a_nul_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What ``resume=last`` from the step-3 checkpoint does: its logger opens the file (repairs it)
    and its first row (step 4) drops the rows of steps 4 and 5."""
    intact = _killed_run(tmp_path)
    (tmp_path / "metrics.csv").write_bytes(intact + b"\0" * 64)
    resumed = RunCSVLogger(str(tmp_path))
    resumed.log_metrics({"train/loss": 0.2}, step=4)
    resumed.save()
    lines = (tmp_path / "metrics.csv").read_bytes().splitlines(keepends=True)
    assert lines[:5] == intact.splitlines(keepends=True)[:5]  # header and steps 0..3
    with open(tmp_path / "metrics.csv", newline="") as file:
        assert [row["step"] for row in csv.DictReader(file)] == list("01234")
    assert capsys.readouterr().err.count("plait: ") == 1


def test_an_unreadable_header_moves_the_file_aside(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_bytes(b"\0" * 100)
    line = repair_metrics(str(tmp_path / "metrics.csv"))
    assert line is not None and "metrics.csv.damaged" in line
    assert not (tmp_path / "metrics.csv").exists() and (tmp_path / "metrics.csv.damaged").read_bytes() == b"\0" * 100
