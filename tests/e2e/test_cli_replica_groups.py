"""``plait pretrain strategy=ft``: plait's launcher starts the Lighthouse and two replica groups, and
starts a group again after it is killed (`trainer.replica_groups`). Slow: whole CLI runs (~1 minute).
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import CLI_TINY, env_with_tests
from safetensors.torch import load_file


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def _group_pids(run_dir: Path) -> list[int]:
    """The processes of the group running in ``run_dir`` (unique to this test)."""
    out = subprocess.run(["pgrep", "-f", f"run_dir={run_dir} "], capture_output=True, text=True, check=False)
    return [int(pid) for pid in out.stdout.split()]


@pytest.mark.slow
def test_the_launcher_restarts_a_killed_group_which_rejoins(tmp_path):
    steps = 150
    args = [
        *CLI_TINY,
        "strategy=ft",
        "trainer.devices=1",
        f"trainer.max_steps={steps}",
        "callbacks.hf_export.at_end=true",
    ]
    args += ["+callbacks.sleep._target_=harness.SleepPerStep", "+callbacks.sleep.seconds=0.1", f"run_dir={tmp_path}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", "pretrain", *args],
        env=env_with_tests(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while max(_steps(tmp_path / "group1"), default=-1) < 5:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
        time.sleep(0.1)
    for pid in _group_pids(tmp_path / "group1"):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out
    assert "replica group 1 ended (exit -9); restart 1 of 3" in out
    restarted = tmp_path / "group1.restart1"
    assert min(_steps(restarted)) > 5 and max(_steps(restarted)) == max(_steps(tmp_path / "group0")) == steps
    a, b = (
        load_file(tmp_path / "group0" / "hf" / "model.safetensors"),
        load_file(restarted / "hf" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
