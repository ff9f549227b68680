"""``plait rest``: kill -9 inside round 2's fit, then ``resume=last``: rounds 0 and 1 are not redone
(their files untouched), and round 2's traces and held-out result equal an uninterrupted run's.

A round's traces are sampled with seeds fixed by the run's seed, the round, the problem and the
sample (`trainer.rest.rollouts`), and its fit resumes its own last checkpoint bitwise, so the
resumed round trains the same model and scores the same greedy traces.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import plait

from strategies.checkpoint.dcp import is_checkpoint

RUN = (
    "rest", "rest.rounds=2", "rest.arms=[guided]", "rest.problems.train=24", "rest.problems.held_out=8",
    "rest.problems.high=10", "rest.problems.max_target=50", "rest.samples=2", "rest.max_new_tokens=128",
    "rest.budgets=[64,128]", "rest.round0_steps=4", "rest.steps=4", "train.global_batch_size=4",
    "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=0", "trainer.enable_progress_bar=false",
)  # fmt: skip
ROUND2 = Path("round_2") / "guided"


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _stamps(run_dir: Path, *parts: str) -> dict[str, int]:
    """The modification time (ns) of every file under ``run_dir/parts``."""
    root = run_dir.joinpath(*parts)
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_kill_inside_round_2_and_resume(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _ok(plait(*RUN, f"run_dir={straight}"))
    report = json.loads((straight / "rest.json").read_text())
    assert [e["round"] for e in report["arms"]["guided"]] == [0, 1, 2]

    run_dir = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *RUN, f"run_dir={run_dir}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    first = run_dir / ROUND2 / "train" / "checkpoints" / "step_0000002"
    deadline = time.monotonic() + 600
    try:
        while not is_checkpoint(first) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, f"the run ended on its own (exit {process.returncode}):\n{stderr}"
    assert not (run_dir / ROUND2 / "train" / "summary.json").exists(), "the kill came after round 2's fit"

    before = {**_stamps(run_dir, "round_0"), **_stamps(run_dir, "round_1")}
    result = plait(*RUN, f"run_dir={run_dir}", "resume=last")
    _ok(result)
    assert {**_stamps(run_dir, "round_0"), **_stamps(run_dir, "round_1")} == before  # not redone
    for name in ("traces.jsonl", "stats.json", "eval.json"):
        assert (run_dir / ROUND2 / name).read_text() == (straight / ROUND2 / name).read_text(), name
    assert json.loads((run_dir / "rest.json").read_text())["arms"] == report["arms"]
    assert (run_dir / "rest.png").is_file()
