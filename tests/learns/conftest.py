"""The learning tier's session fixture: the selected entries trained once, in one subprocess, one at a
time, started right after collection so that it trains beside the other tests; its tests run last."""

from __future__ import annotations

import ctypes
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
# Entries trained at once beside the tests: one, on the core a single-process test leaves idle (two
# took a share of the other core too, and the tier is done long before the tests are).
JOBS = 1
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
        self.keep = False  # a failed entry's runs stay for a look (named at the end of the session)
        # Its own data cache (or the session's PLAIT_TEST_CACHE_DIR): the session's is set only when the
        # first test starts, after this.
        cache = os.environ.get("PLAIT_TEST_CACHE_DIR") or str(self.work / "cache")
        # One subprocess in a session of its own: its forked workers start from a process that never
        # ran a test, and a timeout stops all of them. Niced: it trains in the cycles the other
        # tests leave idle (most hold one core of two), and they keep their pace.
        self.proc = subprocess.Popen(
            [sys.executable, str(TIER), "--work", str(self.work / "runs"), "--json", str(self.out)]
            + ["--only", ",".join(names), "--jobs", str(JOBS), "--timeout-s", str(TIMEOUT_S)]
            + ["--remove-on-term", str(self.work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_CACHE_DIR": cache},
            preexec_fn=_background,
        )

    def results(self) -> dict[str, dict]:
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            stdout, stderr = self.proc.communicate()
        if not self.out.exists():
            self.keep = True
            pytest.fail(
                f"the learning tier did not finish (exit {self.proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
            )
        from learns.entries import passed

        results = json.loads(self.out.read_text())
        self.keep = not all(passed(name, result) for name, result in results.items())
        return results

    def stop(self) -> None:
        if self.proc.poll() is None:  # the session ended early (-x, a failure): SIGTERM lets it stop its workers
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _background() -> None:
    """In the tier's process before it starts: niced, and SIGTERM when pytest dies (Linux'
    PR_SET_PDEATHSIG; its own session does not get pytest's signals), which stops its workers and
    removes its folder (``tier.py --remove-on-term``)."""
    os.nice(NICE)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc
        pass


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
    if not _RESULTS and not any(tier.keep for tier in _TIER):
        return
    from learns.golden import golden_line
    from learns.tier import line

    terminalreporter.section("learning tier (tests/learns)")
    for tier in _TIER:
        if tier.keep:
            terminalreporter.write_line(f"learns: the runs are kept in {tier.work}")
    for name, result in _RESULTS.items():
        terminalreporter.write_line(line(name, result))
    for name in _RESULTS:
        if text := golden_line(name, _RESULTS):
            terminalreporter.write_line(text)
