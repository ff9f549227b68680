"""Bad input fails fast: every problem in one message, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from harness import CLI_TINY, plait

from trainer.compose import bundled_recipes


def _assert_clean_failure(result: subprocess.CompletedProcess[str]) -> str:
    """Exit code 2 with a plait error and no traceback; returns stderr."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "plait: error:" in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    return result.stderr


def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``root``: (mtime in ns, content hash or link target)."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            state[str(path.relative_to(root))] = (path.lstat().st_mtime_ns, "-> " + os.readlink(path))
        elif path.is_file():
            state[str(path.relative_to(root))] = (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            state[str(path.relative_to(root))] = (path.stat().st_mtime_ns, "dir")
    return state


def test_a_data_group_of_another_recipe_names_the_group_not_its_field(tmp_path: Path) -> None:
    """``plait kto data=stream data.path=x``: data.path is stream's field, so the refusal is the
    objective's (use data=preference), not 'Could not override data.path', and the alias's own
    data.unpaired=true, which stream lacks, adds no line of its own."""
    stderr = _assert_clean_failure(plait("kto", "data=stream", "data.path=x", f"run_dir={tmp_path / 'run'}", cwd=tmp_path))
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert [p for p in problems if "data.path=x" not in p] == [
        "  - objective KTO trains on preference pairs; use data=preference (or preference_synthetic)"
    ], stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    bad = ["train.micro_batch=3", "trainer.max_steps=abc", "train.global_batch_size=7", "data.seq_len=4096"]
    stderr = _assert_clean_failure(plait(*CLI_TINY, *bad, f"run_dir={run_dir}", cwd=tmp_path))
    assert "invalid configuration" in stderr
    problems = [line for line in stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 4, stderr
    assert any("train.micro_batch" in p and "train.micro_batch_size" in p for p in problems), stderr  # did you mean
    assert any("trainer.max_steps='abc'" in p and "int" in p for p in problems), stderr
    assert any("train.global_batch_size=7" in p and "multiple" in p for p in problems), stderr
    assert any("data.seq_len=4096" in p and "model.max_seq_len=256" in p for p in problems), stderr
    assert not run_dir.exists() and list(tmp_path.iterdir()) == [], "a failed start must not create a run directory"


@pytest.mark.slow
def test_missing_data_path_names_the_fix(tmp_path: Path) -> None:
    stderr = _assert_clean_failure(plait(*CLI_TINY, "data.path=/nonexistent", f"run_dir={tmp_path / 'run'}", cwd=tmp_path))
    assert "data.path=/nonexistent does not exist" in stderr
    assert "point data.path at" in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_fresh_start_into_a_run_with_checkpoints_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_0000004"
    (step / "rng").mkdir(parents=True)
    files = {".metadata": b"dcp", "__0_0.distcp": b"weights", "meta.pt": b"loop", "rng/rank_00000.pt": b"rng"}
    for name, data in files.items():
        (step / name).write_bytes(data)
    (run_dir / "checkpoints" / "last").symlink_to(step.name)
    (run_dir / "config.yaml").write_text("recipe: pretrain\n")
    (run_dir / "metrics.csv").write_text("step,train/loss\n0,8.3\n")
    before = _tree(tmp_path)

    stderr = _assert_clean_failure(plait(*CLI_TINY, f"run_dir={run_dir}", cwd=tmp_path))
    assert f"run_dir={run_dir} already holds checkpoints" in stderr
    assert "resume=last" in stderr
    assert _tree(tmp_path) == before, "the refused run changed the existing run directory"


def test_unknown_recipe_lists_the_bundled_ones(tmp_path: Path) -> None:
    stderr = _assert_clean_failure(plait("pretrian", *CLI_TINY, cwd=tmp_path))
    assert "unknown recipe 'pretrian'" in stderr
    listed = stderr.split("bundled recipes:", 1)[1]
    assert bundled_recipes() and all(name in listed for name in bundled_recipes())
    stderr = _assert_clean_failure(plait(str(tmp_path / "nope.yaml"), cwd=tmp_path))
    assert "nope.yaml does not exist" in stderr
    assert list(tmp_path.iterdir()) == []
