"""A run killed (SIGKILL of its process group) while a background save writes keeps its previous
checkpoint as ``last``; the half-written one is a ``.tmp`` directory without a manifest, and
``resume=last`` continues bit-exact with each step once in metrics.csv (bench/crash_trials.py
--async-save runs more kill points)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import TINY, assert_resumed_bit_exact, plait

from strategies.checkpoint.dcp import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RUN = (
    *TINY,
    "logger=csv",
    "trainer.max_steps=6",
    "callbacks.checkpoint.every_n_steps=2",
    "callbacks.checkpoint.keep_last=2",
)
ASYNC = "callbacks.checkpoint.async_save=true"


@pytest.mark.slow
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_selected(tmp_path: Path) -> None:
    straight = tmp_path / "straight"  # synchronous: the killed and resumed async run must equal it
    assert plait(*RUN, f"run_dir={straight}").returncode == 0
    run_dir = tmp_path / "killed"
    killed = subprocess.run(  # killed when rank 0's thread has written step 4's shards, before its manifest
        [sys.executable, str(ROOT / "bench" / "crash_entry.py"), *RUN, ASYNC, f"run_dir={run_dir}"],
        cwd=ROOT,
        env={**os.environ, "PLAIT_CRASH_AT": "background:2"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # the kill takes the run's process group, not pytest's
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "last").readlink() == Path("step_0000002")
    assert verify_checkpoint(checkpoints / "step_0000002") is None
    assert not (checkpoints / "step_0000004").exists()
    assert not (checkpoints / "step_0000004.tmp" / "manifest.json").exists()
    with open(run_dir / "metrics.csv", newline="") as file:  # the kill came after step 4's row, during training
        assert max(int(row["step"]) for row in csv.DictReader(file)) >= 4
    assert_resumed_bit_exact(run_dir, straight, [*RUN, ASYNC], resumed_from=2)
