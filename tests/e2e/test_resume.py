"""Kill-and-resume through the CLI is bit-exact, and a crash during a save loses nothing.

A straight run of 2N steps is the reference. A second run with the same settings is killed with
SIGKILL right after its step-N checkpoint appears, then continued with ``resume=last``: its losses
of steps N+1..2N must be bitwise equal to the reference (model, optimizer, scheduler, RNG and data
position all restored).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import CLI_TINY, assert_resumed_bit_exact, plait, train_rows
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import is_checkpoint
from trainer.config import ConfigError
from trainer.run import check_run_dir
from trainer.rundir import resolve_checkpoint

N = 3
RUN = [o for o in CLI_TINY if not o.startswith("trainer.max_steps=")] + [
    f"trainer.max_steps={2 * N}",
    f"callbacks.checkpoint.every_n_steps={N}",
    "callbacks.checkpoint.keep_last=0",
]
STEP_N = f"step_{N:07d}"
STEP_2N = f"step_{2 * N:07d}"


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _ok(plait(*RUN, f"run_dir={run_dir}"))
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the same settings, SIGKILLed as soon as its step-N checkpoint is complete."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    step_n = run_dir / "checkpoints" / STEP_N
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *RUN, f"run_dir={run_dir}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not is_checkpoint(step_n) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, (
        f"the run ended on its own (exit {process.returncode}):\n{stderr[-3000:]}"
    )
    assert is_checkpoint(step_n), "no step-N checkpoint before the kill"
    assert not (run_dir / "checkpoints" / STEP_2N).exists() and not (run_dir / "summary.json").exists(), (
        "the kill came after the run had finished; the resume would have nothing to do"
    )
    return run_dir


def _copy(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to, symlinks=True)
    return to


def _assert_resumed_bit_exact(run_dir: Path, straight: Path) -> None:
    assert_resumed_bit_exact(run_dir, straight, RUN, resumed_from=N)
    assert is_checkpoint(run_dir / "checkpoints" / STEP_2N)
    assert os.readlink(run_dir / "checkpoints" / "last") == STEP_2N


@pytest.mark.slow
def test_kill_and_resume_is_bit_exact(straight: Path, killed: Path, tmp_path: Path) -> None:
    run_dir = _copy(killed, tmp_path / "run")
    assert resolve_checkpoint(run_dir) == (run_dir / "checkpoints" / STEP_N).resolve()
    _assert_resumed_bit_exact(run_dir, straight)


@pytest.mark.slow
def test_crash_during_save_keeps_the_previous_checkpoint(straight: Path, killed: Path, tmp_path: Path) -> None:
    run_dir = _copy(killed, tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    # The step-N save completed (the kill may have come before its link moved; finish that).
    (checkpoints / "last").unlink(missing_ok=True)
    (checkpoints / "last").symlink_to(STEP_N)
    # A crash in the middle of the step-2N save: DCP wrote part of its files into the .tmp
    # directory (no meta.pt yet), and a half-made link to it was left behind.
    partial = checkpoints / f"{STEP_2N}.tmp"
    partial.mkdir()
    shutil.copy(checkpoints / STEP_N / ".metadata", partial / ".metadata")
    shard = next((checkpoints / STEP_N).glob("*.distcp"))
    (partial / shard.name).write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    (checkpoints / ".last.tmp").symlink_to(partial.name)

    assert not is_checkpoint(partial)
    assert (checkpoints / "last").resolve() == (checkpoints / STEP_N).resolve()
    assert resolve_checkpoint(run_dir) == (checkpoints / STEP_N).resolve()
    cfg = OmegaConf.create({"run_dir": str(run_dir), "resume": "last"})
    assert check_run_dir(cfg) == (checkpoints / STEP_N).resolve()

    _assert_resumed_bit_exact(run_dir, straight)
    assert not partial.exists(), "the next save must clear the partial directory"


def test_crash_before_the_last_link_moves(killed: Path, tmp_path: Path) -> None:
    """Killed between a save's rename and the ``last`` update of the first checkpoint: no link yet.
    resume=last still finds the newest complete checkpoint, and a fresh start is still refused."""
    run_dir = _copy(killed, tmp_path / "run")
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "last").unlink(missing_ok=True)
    (checkpoints / f"{STEP_2N}.tmp").mkdir()  # a later save that never completed
    shutil.copytree(checkpoints / STEP_N, checkpoints / f"step_{2 * N + 1:07d}.old")  # complete-looking leftovers
    shutil.copytree(checkpoints / STEP_N, checkpoints / f"step_{2 * N + 2:07d}.tmp")
    assert resolve_checkpoint(run_dir) == (checkpoints / STEP_N).resolve()
    assert (
        check_run_dir(OmegaConf.create({"run_dir": str(run_dir), "resume": "last"})) == (checkpoints / STEP_N).resolve()
    )
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        check_run_dir(OmegaConf.create({"run_dir": str(run_dir), "resume": None}))


def test_resume_refuses_another_run_and_applies_an_override(killed: Path, tmp_path: Path) -> None:
    """A resume whose config differs in the model or an unnamed optimizer field is refused before
    anything is written, every difference listed; with ``resume_override=[optim.lr]`` the new lr
    is the one the resumed steps use, and config.yaml records it only once the checkpoint loaded."""
    from trainer.optim import lr_factor

    run_dir = _copy(killed, tmp_path / "run")
    before = {p: (run_dir / p).read_bytes() for p in ("config.yaml", "tokenizer.json", "metrics.csv")}
    result = plait(*RUN, f"run_dir={run_dir}", "resume=last", "model.dim=32", "optim.lr=1e-3")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "plait: error: invalid configuration:" in result.stderr
    assert "model.dim=32 differs from" in result.stderr and "resume_override=[optim.lr]" in result.stderr
    assert {p: (run_dir / p).read_bytes() for p in before} == before  # nothing rewritten

    _ok(plait(*RUN, f"run_dir={run_dir}", "resume=last", "optim.lr=1e-3", "resume_override=[optim.lr]"))
    rows = train_rows(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.optim.lr == 1e-3 and list(cfg.resume_override) == ["optim.lr"]
    sched = cfg.scheduler
    for step in range(N + 1, 2 * N + 1):
        expected = 1e-3 * lr_factor(
            step - 1,
            warmup_steps=sched.warmup_steps,
            total_steps=2 * N,
            decay=sched.decay,
            min_lr_ratio=sched.min_lr_ratio,
        )
        assert float(rows[step]["train/lr"]) == pytest.approx(expected, rel=1e-6), (
            step,
            rows[step]["train/lr"],
            expected,
        )
