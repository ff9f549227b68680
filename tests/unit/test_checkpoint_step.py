"""A checkpoint to resume from is the step its name says: a ``meta.pt`` copied in from another
checkpoint (the manifest rewritten to match), a renamed directory, or an optimizer state of more
updates than the loop ran is refused with one line naming the checkpoint to resume from instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.dcp import META_FILE, CheckpointError
from strategies.checkpoint.manifest import MANIFEST
from trainer.checkpoint_step import meta_step, optimizer_step, step_problem
from trainer.run import check_run_dir


def _save(path: Path, *, updates: int, global_step: int) -> Path:
    """A checkpoint after ``updates`` AdamW updates whose loop state says ``global_step``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(updates):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    ckpt.save(path, model=model, optimizers=[optimizer], meta={"global_step": global_step})
    return path


def _reseal(path: Path) -> None:
    """What someone who copied a file in also does: the manifest rewritten, so it verifies."""
    (path / MANIFEST).unlink()
    ckpt.seal(path)
    assert ckpt.verify_checkpoint(path) is None


@pytest.fixture()
def checkpoints(tmp_path: Path) -> Path:
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        _save(root / f"step_{step:07d}", updates=step, global_step=step)
    (root / "last").symlink_to("step_0000004")
    return root


def test_intact_checkpoints_and_skipped_updates_pass(checkpoints: Path, tmp_path: Path) -> None:
    step_4 = checkpoints / "step_0000004"
    assert (meta_step(step_4), optimizer_step(step_4), step_problem(step_4)) == (4, 4, None)
    skipped = _save(tmp_path / "step_0000005", updates=3, global_step=5)  # two non-finite steps skipped
    assert step_problem(skipped) is None


def test_a_meta_pt_of_another_checkpoint_is_refused(checkpoints: Path) -> None:
    step_2, step_4 = checkpoints / "step_0000002", checkpoints / "step_0000004"
    shutil.copy(step_2 / META_FILE, step_4 / META_FILE)
    _reseal(step_4)
    problem = step_problem(step_4)
    assert problem is not None and "\n" not in problem
    assert (
        f"{step_4}/meta.pt records step 2, its directory name says step 4, its optimizer state counts 4 updates: its weights"
        in problem
    )
    assert f"resume={step_2}" in problem  # the fix: the checkpoint before it
    cfg = OmegaConf.create({"run_dir": str(checkpoints.parent), "resume": "last"})
    with pytest.raises(CheckpointError, match="records step 2"):
        check_run_dir(cfg)
    assert (
        check_run_dir(OmegaConf.create({"run_dir": str(checkpoints.parent), "resume": str(step_2)})) == step_2.resolve()
    )


def test_a_renamed_directory_is_refused(checkpoints: Path) -> None:
    (checkpoints / "step_0000004").rename(checkpoints / "step_0000009")
    problem = step_problem(checkpoints / "step_0000009")
    assert (
        problem is not None
        and "records step 4, its directory name says step 9, its optimizer state counts 4 updates" in problem
    )


def test_an_optimizer_state_ahead_of_the_loop_is_refused(tmp_path: Path) -> None:
    ahead = _save(tmp_path / "step_0000002", updates=3, global_step=2)
    problem = step_problem(ahead)
    assert (
        problem is not None
        and "records step 2, its directory name says step 2, its optimizer state counts 3 updates" in problem
    )
    assert "start a new run_dir (no earlier checkpoint" in problem
