"""``plait compare`` names the runs that have no validation loss instead of counting them as drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.compare import main


def _run(path: Path, rows: str) -> None:
    path.mkdir(parents=True)
    (path / "metrics.csv").write_text("step,train/loss,val/loss\n" + rows)


def test_a_crashed_run_is_named_not_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "ok", "0,,8.3\n1,8.2,\n2,8.1,8.0\n")
    _run(tmp_path / "crashed", "1,8.2,\n")  # died before its first evaluation after step 0
    main([str(tmp_path), f"out={tmp_path / 'c.png'}"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"plait: wrote {tmp_path / 'c.png'} (validation loss of 1 run; no validation loss in crashed)"
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
