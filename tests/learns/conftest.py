"""The learning tier's session fixture: the selected entries trained once, in one subprocess, two at a
time, started right after collection so that it trains beside the other tests; its tests run last."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TIER = Path(__file__).with_name("tier.py")
TIMEOUT_S = 1800  # the tier's own deadline, and the longest the last test waits for it
NICE = 10
_RESULTS: dict[str, dict] = {}


def _selected(session: pytest.Session) -> list[str]:
    """The entries whose tier tests this session runs (``-k dpo`` trains dpo and its base only);
    other tests' parameters named ``name`` are not entries."""
    return sorted(
        {item.callspec.params["name"] for item in session.items if "tier_results" in getattr(item, "fixturenames", ())}
    )


class _Tier:
    """The tier's subprocess, started once the session's selection is known."""

    def __init__(self, names: list[str]) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="plait-learns-"))
        self.out = self.work / "results.json"
        # One subprocess in a session of its own: its forked workers start from a process that never
        # ran a test, and a timeout stops all of them. Niced: it trains in the cycles the other
        # tests leave idle (most hold one core of two), and they keep their pace.
        self.proc = subprocess.Popen(
            [sys.executable, str(TIER), "--work", str(self.work / "runs"), "--json", str(self.out)]
            + ["--only", ",".join(names), "--timeout-s", str(TIMEOUT_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: os.nice(NICE),
        )

    def results(self) -> dict[str, dict]:
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            stdout, stderr = self.proc.communicate()
        if not self.out.exists():
            pytest.fail(
                f"the learning tier did not finish (exit {self.proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
            )
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
        shutil.rmtree(self.work, ignore_errors=True)


_TIER: list[_Tier] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier's tests run last: the tier trains beside every other test, and the session waits
    for it only at the end."""
    tier = [item for item in items if "tier_results" in getattr(item, "fixturenames", ())]
    if tier:
        rest = [item for item in items if "tier_results" not in getattr(item, "fixturenames", ())]
        items[:] = rest + tier


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts the tier's subprocess for the selected entries (none selected: none started)."""
    if not session.config.option.collectonly and (names := _selected(session)):
        _TIER.append(_Tier(names))


def pytest_sessionfinish() -> None:
    for tier in _TIER:
        tier.stop()


@pytest.fixture(scope="session")
def tier_results() -> dict[str, dict]:
    """Each selected entry's result (`learns.tier.run_entry`): its checks' values, evaluations,
    first steps; or an error. Trained by the subprocess `pytest_collection_finish` started."""
    if not _RESULTS:
        _RESULTS.update(_TIER[0].results())
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
