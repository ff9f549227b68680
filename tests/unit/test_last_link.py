"""``checkpoints/last`` is checked before it is used or replaced: a directory or a file there (not
the link plait moves) refuses a resume with one line before anything is written, a save refuses
before writing, and a failed move of the link leaves no ``.last.tmp``."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import CheckpointError
from trainer.callbacks.checkpoint import PeriodicCheckpoint
from trainer.run import check_run_dir
from trainer.rundir import RunDir, last_link_problem


def _run_with_last(tmp_path: Path, kind: str) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.step(3).mkdir(parents=True)
    if kind == "link":
        run.last.symlink_to(run.step(3).name)
    elif kind == "directory":
        run.last.mkdir()
        (run.last / "meta.pt").write_bytes(b"someone's copy")
    elif kind == "file":
        run.last.write_text("step_0000003\n")
    return run


@pytest.mark.parametrize("kind", ["link", "absent"])
def test_the_link_plait_writes_or_none_is_fine(tmp_path: Path, kind: str) -> None:
    assert last_link_problem(_run_with_last(tmp_path, kind).checkpoints) is None


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_resume_into_a_run_whose_last_is_not_a_link_is_refused(tmp_path: Path, kind: str) -> None:
    run = _run_with_last(tmp_path, kind)
    before = sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*"))
    with pytest.raises(CheckpointError) as raised:
        check_run_dir(OmegaConf.create({"run_dir": str(run.path), "resume": "last"}))
    message = str(raised.value)
    assert "\n" not in message and f"{run.last} is a {kind}, not the link plait moves" in message
    assert f"mv {run.last} {run.path / 'last.moved'}" in message
    assert sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*")) == before


def _trainer(step: int) -> Any:
    """What `PeriodicCheckpoint.save` uses of a one-process trainer; its save makes an empty step directory."""
    strategy = SimpleNamespace(broadcast=lambda value: value, barrier=lambda: None)
    trainer = SimpleNamespace(global_step=step, is_global_zero=True, loggers=[], strategy=strategy, saved=[])
    trainer.save_checkpoint = lambda path, weights_only: (trainer.saved.append(path), Path(path).mkdir())
    return trainer


def test_a_save_checks_last_before_it_writes(tmp_path: Path) -> None:
    run = _run_with_last(tmp_path, "directory")
    trainer = _trainer(6)
    with pytest.raises(CheckpointError, match="is a directory, not the link plait moves"):
        PeriodicCheckpoint(dirpath=str(run.checkpoints)).save(trainer)
    assert trainer.saved == [] and sorted(p.name for p in run.checkpoints.iterdir()) == ["last", "step_0000003"]


def test_a_failed_move_of_last_leaves_no_tmp_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_with_last(tmp_path, "link")

    def replace(src: Any, dst: Any) -> None:
        raise OSError(28, os.strerror(28), str(dst))

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        PeriodicCheckpoint(dirpath=str(run.checkpoints)).save(_trainer(6))
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["last", "step_0000003", "step_0000006"]
    assert os.readlink(run.last) == "step_0000003"
