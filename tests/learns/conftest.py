"""The learning tier's session fixture: the selected entries trained once, in one subprocess, two at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TIER = Path(__file__).with_name("tier.py")
TIMEOUT_S = 1800
_RESULTS: dict[str, dict] = {}


def _selected(session: pytest.Session) -> list[str]:
    """The entries whose tier tests this session runs (``-k dpo`` trains dpo and its base only);
    other tests' parameters named ``name`` are not entries."""
    return sorted(
        {item.callspec.params["name"] for item in session.items if "tier_results" in getattr(item, "fixturenames", ())}
    )


@pytest.fixture(scope="session")
def tier_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each selected entry's result (`learns.tier.run_entry`): its checks' values, evaluations,
    first steps; or an error."""
    work = tmp_path_factory.mktemp("learns")
    out = work / "results.json"
    names = _selected(request.session)
    # One subprocess in a session of its own: its forked workers start from a process that never
    # ran a test, and a timeout stops all of them.
    proc = subprocess.Popen(
        [sys.executable, str(TIER), "--work", str(work / "runs"), "--json", str(out), "--only", ",".join(names)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    if not out.exists():
        pytest.fail(f"the learning tier did not finish (exit {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    _RESULTS.update(json.loads(out.read_text()))
    return _RESULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per entry of the tier: its checks' values and thresholds, the verdict."""
    if not _RESULTS:
        return
    from learns.golden import golden_line
    from learns.tier import line

    terminalreporter.section("learning tier (tests/learns)")
    for name, result in _RESULTS.items():
        terminalreporter.write_line(line(name, result))
    for name in _RESULTS:
        if text := golden_line(name, _RESULTS):
            terminalreporter.write_line(text)
