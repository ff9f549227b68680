"""``plait sft budget=msft`` from the command line, with torch's own thread count: the roll-outs are
forked from the launching process, and a fork of a process whose OpenMP pool has run hangs in its
first parallel region. With the tiny model the search hung in roll-out 0's first forward until the
launching process kept to one thread (`trainer.budget.driver.run_search`); the suite's
OMP_NUM_THREADS=1 hid it, so this test runs without it."""

from __future__ import annotations

import json
import os

import pytest
from harness import plait


@pytest.mark.slow
def test_a_budget_search_with_threads_finishes(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run_dir = tmp_path / "run"
    args = ("sft", "data=synthetic", "budget=msft", "budget.compute=0.1", "budget.baseline=false")
    result = plait(*args, "trainer.enable_progress_bar=false", f"run_dir={run_dir}", env=env, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "msft.json").read_text())
