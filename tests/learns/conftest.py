"""The learning tier's session fixture: every entry trained once, in one subprocess, two at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIER = Path(__file__).with_name("tier.py")
_RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="session")
def tier_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each entry's result (`learns.tier.run_entry`): measure, evaluations, first steps; or an error."""
    work = tmp_path_factory.mktemp("learns")
    out = work / "results.json"
    # One subprocess: its forked workers start from a process that never ran a test.
    proc = subprocess.run(
        [sys.executable, str(TIER), "--work", str(work / "runs"), "--json", str(out)],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if not out.exists():
        pytest.fail(f"the learning tier did not finish (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    _RESULTS.update(json.loads(out.read_text()))
    return _RESULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per entry of the tier: its measured value, the threshold, the verdict."""
    if not _RESULTS:
        return
    from learns.tier import line

    terminalreporter.section("learning tier (tests/learns/tier.py)")
    for name, result in _RESULTS.items():
        terminalreporter.write_line(line(name, result))
