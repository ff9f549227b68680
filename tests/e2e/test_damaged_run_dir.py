"""A run directory damaged on disk is healed or refused through the CLI, with one line each.

- ``metrics.csv`` ending in NUL bytes (a power cut): ``resume=last`` drops them, says so, and
  ends bitwise equal to an uninterrupted run;
- ``checkpoints/last`` that is a directory, and a checkpoint whose ``meta.pt`` records another
  step than its name and optimizer state: refused with one ``plait: error:`` line (exit 2)
  before anything is written;
- a full disk during a save (``OSError(ENOSPC)`` from every file DCP writes, `harness.DiskFullAt`):
  one ``plait: error:`` line naming the file and the space needed, no ``.tmp`` left, the
  earlier checkpoint kept.

The damaged runs are copies of one straight run of 2N steps (checkpoints at N and 2N) turned
into what a run killed before its step-2N checkpoint leaves: that checkpoint removed, ``last``
-> step N. The refusals run on tiny hand-made checkpoints: they stop before any data is read.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from harness import CLI_TINY, assert_resumed_bit_exact, env_with_tests, plait
from torch import nn

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.dcp import META_FILE
from strategies.checkpoint.manifest import MANIFEST
from trainer.rundir import RunDir

N = 3
RUN = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    f"trainer.max_steps={2 * N}",
    f"callbacks.checkpoint.every_n_steps={N}",
    "callbacks.checkpoint.keep_last=0",
]


def _tree(path: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target below ``path``: a run directory, to compare."""
    return {
        str(p.relative_to(path)): (str(p.readlink()) if p.is_symlink() else p.read_bytes())
        for p in sorted(path.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The run's only stderr line, a ``plait: error:`` line of exit 2."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    result = plait(*RUN, f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _killed_copy(straight: Path, to: Path) -> RunDir:
    """``straight`` as a run killed after its last row, before its step-2N checkpoint, leaves it."""
    shutil.copytree(straight, to, symlinks=True)
    run = RunDir(to)
    shutil.rmtree(run.step(2 * N))
    run.summary.unlink()
    run.last.unlink()
    run.last.symlink_to(run.step(N).name)
    return run


@pytest.mark.slow
def test_a_nul_tail_of_metrics_is_dropped_and_the_resume_is_bit_exact(straight: Path, tmp_path: Path) -> None:
    run = _killed_copy(straight, tmp_path / "run")
    with open(run.metrics, "ab") as file:
        file.write(b"\0" * 300)  # the size reached the disk, the data did not
    result = assert_resumed_bit_exact(run.path, straight, RUN, resumed_from=N)
    said = [line for line in result.stderr.splitlines() if "damaged line" in line]
    assert said == [
        f"plait: {run.metrics}: dropped 1 damaged line(s) of 300 bytes (NUL bytes, what a power cut "
        f"leaves) after the row of step {2 * N}; the other rows are kept"
    ], result.stderr[-3000:]
    assert b"\0" not in run.metrics.read_bytes()


@pytest.mark.slow
def test_a_full_disk_during_a_save_says_one_line_and_keeps_the_earlier_checkpoint(
    straight: Path, tmp_path: Path
) -> None:
    run = _killed_copy(straight, tmp_path / "run")
    full = ("+callbacks.full._target_=harness.DiskFullAt", f"+callbacks.full.step={2 * N}")
    result = plait(*RUN, *full, f"run_dir={run.path}", "resume=last", env=env_with_tests())
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    tmp = f"{run.step(2 * N)}.tmp"
    assert errors[0].startswith(
        f"plait: error: not saving step_{2 * N:07d}: No space left on device (ENOSPC) writing {tmp}/"
    )
    assert "the checkpoint needs about" in errors[0] and "resume=last" in errors[0]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["last", run.step(N).name]  # no .tmp, no .last.tmp
    assert ckpt.verify_checkpoint(run.step(N)) is None and run.last.resolve() == run.step(N).resolve()


def _hand_made_run(path: Path, steps: tuple[int, ...]) -> RunDir:
    """A run directory with AdamW checkpoints of a tiny model at ``steps`` (each after that many
    updates, its ``meta.pt`` recording the step) and ``last`` -> the newest; no run record, so the
    resume is checked only for the damage here."""
    run = RunDir(path)
    for step in steps:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(step):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        ckpt.save(run.step(step), model=model, optimizers=[optimizer], meta={"global_step": step})
    run.last.symlink_to(run.step(steps[-1]).name)
    return run


@pytest.mark.slow
def test_a_last_directory_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = _hand_made_run(tmp_path / "run", (N,))
    run.last.unlink()
    shutil.copytree(run.step(N), run.last)  # a copy made by hand where plait keeps its link
    before = _tree(run.path)
    line = _one_error_line(plait(*RUN, f"run_dir={run.path}", "resume=last"))
    assert line.startswith(f"plait: error: {run.last} is a directory, not the link plait moves to each new checkpoint")
    assert f"mv {run.last} " in line
    assert _tree(run.path) == before


@pytest.mark.slow
def test_a_meta_pt_of_another_step_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = _hand_made_run(tmp_path / "run", (N, 2 * N))
    shutil.copy(run.step(N) / META_FILE, run.step(2 * N) / META_FILE)
    (run.step(2 * N) / MANIFEST).unlink()
    ckpt.seal(run.step(2 * N))  # the manifest rewritten to match: it verifies
    before = _tree(run.path)
    line = _one_error_line(plait(*RUN, f"run_dir={run.path}", "resume=last"))
    assert line.startswith(
        f"plait: error: {run.step(2 * N)}/meta.pt records step {N}, its directory name says step {2 * N}, "
        f"its optimizer state counts {2 * N} updates"
    )
    assert f"resume={run.step(N)}" in line  # the fix: the checkpoint before it
    assert _tree(run.path) == before
