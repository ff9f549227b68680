"""A rank that dies or stops ends a 2-process CLI run with plait's line and exit 4, never a hang or
the launcher's SIGKILL (issue 38 item 2).

- SIGKILL of rank 1: rank 0 prints ``plait: error: lost rank 1`` and exits 4 (Lightning's child
  observer used to SIGKILL it first: exit -9, "Forcefully terminating all other processes").
- SIGSTOP of rank 0 (the heartbeat store's host): rank 1 names it, and past ``strategy.timeout_s``
  ends itself with the line naming rank 0 and its step (its watchdog's, or its lost-rank line when
  the backend's timeout fires first; before, its exit hung on a store write to the stopped host);
  continued, rank 0 finds rank 1 gone and exits 4 at once.
- SIGSTOP of rank 1 for less than ``strategy.timeout_s``: named, then said to answer again, and the
  run's losses equal an uninterrupted run's.

Steps sleep (`harness.SleepPerStep`) so the signals land mid-run. The references are the
processes' exit codes and stderr, and the uninterrupted run's metrics.csv, read here.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import CLI_TINY, env_with_tests

pytestmark = pytest.mark.slow

TIMEOUT_S, HEARTBEAT_S = 30, 8  # the heartbeat's interval is HEARTBEAT_S / 4
RUN = [o for o in CLI_TINY if not o.startswith(("trainer.max_steps=", "strategy.timeout_s="))] + [
    "trainer.devices=2", f"strategy.timeout_s={TIMEOUT_S}", f"strategy.heartbeat_s={HEARTBEAT_S}",
    "callbacks.checkpoint.every_n_steps=1000", "+callbacks.sleep._target_=harness.SleepPerStep", "+callbacks.sleep.seconds=0.5",
]  # fmt: skip


class _Run:
    """``plait *RUN`` in its own session, stderr read as it comes; ``rank(0)`` / ``rank(1)`` its pids."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        self.run_dir, self.lines = run_dir, []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.cli", *RUN, f"trainer.max_steps={steps}", f"run_dir={run_dir}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env_with_tests(),
        )
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while step not in _losses(self.run_dir):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()
            time.sleep(0.1)

    def rank(self, rank: int) -> int:
        if rank == 0:
            return self.proc.pid
        return int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()[0])

    def stderr(self) -> str:
        return "".join(self.lines)[-6000:]

    def end(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> float:
    start = time.monotonic()
    while _alive(pid) and time.monotonic() - start < seconds:
        time.sleep(0.2)
    return time.monotonic() - start


def _losses(run_dir: Path) -> dict[int, str]:
    """step -> train/loss as written in metrics.csv ({} before it exists)."""
    if not (run_dir / "metrics.csv").exists():
        return {}
    with open(run_dir / "metrics.csv", newline="") as file:
        return {int(r["step"]): r["train/loss"] for r in csv.DictReader(file) if r.get("train/loss")}


def test_a_killed_rank_ends_its_survivor_with_the_lost_rank_line_and_exit_4(tmp_path: Path) -> None:
    run = _Run(tmp_path / "run", steps=400)
    try:
        run.wait_for_step(3)
        os.kill(run.rank(1), signal.SIGKILL)
        run.proc.wait(timeout=60)
    finally:
        run.end()
    assert run.proc.returncode == 4, (run.proc.returncode, run.stderr())
    assert re.search(r"plait: error: lost rank 1 at step \d+ \(", run.stderr()), run.stderr()
    assert "Forcefully terminating" not in run.stderr()


def test_a_stopped_store_host_is_ended_past_the_timeout_and_exits_when_continued(tmp_path: Path) -> None:
    run = _Run(tmp_path / "run", steps=400)
    try:
        run.wait_for_step(3)
        rank1 = run.rank(1)
        os.kill(run.proc.pid, signal.SIGSTOP)
        waited = _gone_within(rank1, TIMEOUT_S + 30)
        assert not _alive(rank1), f"rank 1 still runs {waited:.0f} s after rank 0 stopped:\n{run.stderr()}"
        os.kill(run.proc.pid, signal.SIGCONT)
        run.proc.wait(timeout=15)  # at once: its collectives fail on the rank that left
    finally:
        run.end()
    assert run.proc.returncode == 4, (run.proc.returncode, run.stderr())
    assert re.search(
        r"plait: rank 0 \(it hosts the heartbeat store\) has not answered for \d+ s \(its last heartbeat was at step \d+\)",
        run.stderr(),
    )
    # Rank 1 ends by its watchdog or, when the backend's timeout comes first, by its lost-rank line.
    ended = (
        rf"plait: error: rank 0 has not answered for \d+ s \(in step \d+\), past strategy.timeout_s={TIMEOUT_S}",
        r"plait: error: lost rank 0 at step \d+ \(it stopped answering and the collective timed out",
    )
    assert any(re.search(line, run.stderr()) for line in ended), run.stderr()


def test_a_rank_stopped_briefly_is_named_then_answers_and_the_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    steps = 12
    straight = _Run(tmp_path / "straight", steps=steps)
    straight.proc.wait(timeout=300)
    assert straight.proc.returncode == 0, straight.stderr()
    run = _Run(tmp_path / "run", steps=steps)
    try:
        run.wait_for_step(3)
        os.kill(run.rank(1), signal.SIGSTOP)
        time.sleep(HEARTBEAT_S + 4)
        os.kill(run.rank(1), signal.SIGCONT)
        run.proc.wait(timeout=300)
    finally:
        run.end()
    assert run.proc.returncode == 0, run.stderr()
    assert (
        re.search(r"plait: rank 1 has not answered for \d+ s", run.stderr())
        and "plait: rank 1 answers again" in run.stderr()
    ), run.stderr()
    assert _losses(run.run_dir) == _losses(straight.run_dir) and len(_losses(straight.run_dir)) == steps
