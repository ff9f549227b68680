"""The learning tier's session plugin (loaded by tests/conftest.py): the selected entries trained
once, in one subprocess, one at a time, started as soon as the session's selection is known so
that it trains beside the other tests; its tests run last and wait for it.

One process owns the tier's subprocess: the session's own, or under pytest-xdist (``-n``) the
controller, which lives until every worker is done. The owner writes ``exit.json`` into the tier's
folder when the subprocess ends; a tier test, in whichever process it runs, waits for that file
and reads ``results.json`` beside it.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

TIER = Path(__file__).with_name("tier.py")
TIMEOUT_S = 1800  # the tier's own deadline, and the longest a tier test waits for it
NICE = 10
# Entries trained at once beside the tests: one, on the core a single-process test leaves idle (two
# took a share of the other core too, and the tier is done long before the tests are).
JOBS = 1
_WORK_KEY = "plait_learns_work"  # xdist's workerinput: the tier's folder, known to every worker
_RESULTS: dict[str, dict] = {}


def _entries_of(nodeids: list[str]) -> list[str]:
    """The entries whose tier tests the session runs (``-k dpo`` trains dpo and its base only), read
    from the tests' ids (``tests/learns/test_learns.py::test_recipe_learns[dpo]``): every test there
    takes its entry as its one parameter."""
    return sorted(
        {
            i.rsplit("[", 1)[1][:-1]
            for i in nodeids
            if i.split("::")[0].endswith("learns/test_learns.py") and i[-1] == "]"
        }
    )


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _work(config: pytest.Config) -> Path:
    """The tier's folder: named by the owner, passed to xdist's workers (`pytest_configure_node`)."""
    if _is_worker(config):
        return Path(config.workerinput[_WORK_KEY])
    if not hasattr(config, "_plait_learns_work"):
        config._plait_learns_work = Path(tempfile.gettempdir()) / f"plait-learns-{uuid.uuid4().hex[:12]}"
    return config._plait_learns_work


class _Tier:
    """The tier's subprocess and the thread that writes ``exit.json`` when it ends.

    Args:
        work: its folder (created here; removed at the end of the session unless an entry failed).
        names: the entries to train.
        nice: added to its niceness: 10 beside one test process (it trains in the idle core's
            cycles), 0 beside xdist's workers (which keep both cores busy; niced, it would train
            only after them, on one core).
    """

    def __init__(self, work: Path, names: list[str], nice: int) -> None:
        self.work = work
        self.work.mkdir(parents=True)
        self.keep = False  # a failed entry's runs stay for a look (named at the end of the session)
        # The session's data cache (tests/conftest.py sets PLAIT_TEST_CACHE_DIR before any worker starts).
        cache = os.environ.get("PLAIT_TEST_CACHE_DIR") or str(self.work / "cache")
        # One subprocess in a session of its own: its forked workers start from a process that never
        # ran a test, and a timeout stops all of them.
        self.proc = subprocess.Popen(
            [sys.executable, str(TIER), "--work", str(self.work / "runs"), "--json", str(self.work / "results.json")]
            + ["--only", ",".join(names), "--jobs", str(JOBS), "--timeout-s", str(TIMEOUT_S)]
            + ["--remove-on-term", str(self.work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PLAIT_CACHE_DIR": cache},
            preexec_fn=lambda: _background(nice),
        )
        self.waiter = threading.Thread(target=self._wait, daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            stdout, stderr = self.proc.communicate()
        if self.work.exists():  # not removed by a SIGTERM (`stop`)
            done = {"exit": self.proc.returncode, "stdout": stdout[-3000:], "stderr": stderr[-3000:]}
            (self.work / ".exit.json").write_text(json.dumps(done))
            os.replace(self.work / ".exit.json", self.work / "exit.json")

    def stop(self) -> None:
        """At the end of the session: reads the results when the tier finished (for the summary),
        stops it when the session ended early (-x, a failure), removes its folder unless an entry failed."""
        stopped = self.proc.poll() is None
        if stopped:  # SIGTERM lets it stop its workers and remove its folder
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.waiter.join(timeout=30)
        if (self.work / "results.json").exists() and not _RESULTS:
            _RESULTS.update(json.loads((self.work / "results.json").read_text()))
        if _RESULTS:
            from learns.entries import passed

            self.keep = not all(passed(name, result) for name, result in _RESULTS.items())
        elif not stopped and (self.work / "exit.json").exists():
            self.keep = True  # it ended on its own without results: its output is in the failed test's message
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def _background(nice: int) -> None:
    """In the tier's process before it starts: niced, and SIGTERM when its owner dies (Linux'
    PR_SET_PDEATHSIG; its own session does not get pytest's signals), which stops its workers and
    removes its folder (``tier.py --remove-on-term``)."""
    os.nice(nice)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc
        pass


_TIER: list[_Tier] = []


def _start(config: pytest.Config, nodeids: list[str], nice: int) -> None:
    if not _TIER and (names := _entries_of(nodeids)):
        _TIER.append(_Tier(_work(config), names, nice))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier's tests run last: the tier trains beside every other test, and the session waits
    for it only at the end."""
    tier = [item for item in items if "tier_results" in getattr(item, "fixturenames", ())]
    if tier:
        rest = [item for item in items if "tier_results" not in getattr(item, "fixturenames", ())]
        items[:] = rest + tier


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without xdist: starts the tier's subprocess for the selected entries (none selected: none)."""
    if not session.config.option.collectonly and not _is_worker(session.config):
        _start(session.config, [item.nodeid for item in session.items], NICE)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001 - xdist's WorkerController
    """xdist's controller, before a worker starts: the worker's tier tests read the tier's folder."""
    node.workerinput[_WORK_KEY] = str(_work(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:  # noqa: ANN001
    """xdist's controller, once the first worker has collected (every worker collects the same
    tests): starts the tier's subprocess, not niced (see `_Tier`)."""
    _start(node.config, ids, 0)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for tier in _TIER:
        tier.stop()


@pytest.fixture(scope="session")
def tier_results(pytestconfig: pytest.Config) -> dict[str, dict]:
    """Each selected entry's result (`learns.tier.run_entry`): its checks' values, evaluations,
    first steps; or an error. Waits for the tier's subprocess, which its owner started."""
    if not _RESULTS:
        work = _work(pytestconfig)
        deadline = time.monotonic() + TIMEOUT_S + 60
        while not (work / "exit.json").exists():
            if time.monotonic() > deadline:
                pytest.fail(f"the learning tier wrote no {work / 'exit.json'} in {TIMEOUT_S + 60} s")
            time.sleep(1)
        if not (work / "results.json").exists():
            done = json.loads((work / "exit.json").read_text())
            pytest.fail(f"the learning tier did not finish (exit {done['exit']}):\n{done['stdout']}\n{done['stderr']}")
        _RESULTS.update(json.loads((work / "results.json").read_text()))
    return _RESULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per entry of the tier: its checks' values and thresholds, the verdict (printed by
    the owner, which read the results in `_Tier.stop`)."""
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
