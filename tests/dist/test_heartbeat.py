"""A stopped rank is named by the rank waiting for it (with its step) while it is stopped, again
when it answers, and as lost after it is killed (gloo processes with the heartbeat thread)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from strategies.runtime.watchdog import Heartbeat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: Path) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    lines = out / f"rank{rank}.txt"
    heartbeat = Heartbeat(stale_s=1.0, interval_s=0.2, report=lambda line: lines.open("a").write(line + "\n"))
    heartbeat.start()
    (out / f"ready{rank}").touch()
    tensor = torch.ones(4)
    try:
        for step in range(1, 100_000):
            heartbeat.set_step(step)
            dist.all_reduce(tensor)
            time.sleep(0.02)
    except RuntimeError:  # the peer was killed: gloo's connection reset
        heartbeat.stop()  # as the strategy's teardown does: no more stall reports
        lost = heartbeat.lost_ranks()
        with lines.open("a") as file:
            file.write(f"LOST {lost}\n{heartbeat.lost_line(lost)}\n")
    os._exit(0)  # gloo's threads may abort a normal exit after a failed collective


def test_a_stopped_then_killed_rank_is_named(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [context.Process(target=_rank, args=(rank, port, tmp_path)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(procs[1].pid, signal.SIGCONT)
        time.sleep(1.5)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[0].join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    report = (tmp_path / "rank0.txt").read_text()
    assert "plait: rank 1 has not answered for 1 s (its last heartbeat was at step " in report, report
    assert report.count("has not answered") == 1, report  # once per stall, not every check
    assert "rank 0 is at step" in report and "plait: rank 1 answers again" in report, report
    assert "LOST [1]" in report and "plait: error: lost rank 1 at step " in report, report


def _stalling_rank(rank: int, port: int, out: Path, stall_rank: int, stall_step: int) -> None:
    """Steps with an all_reduce each; rank ``stall_rank`` stops itself (SIGSTOP) inside step
    ``stall_step``. The watcher's abort writes its exit code and ends the process as plait's does."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    lines = out / f"rank{rank}.txt"

    def report(line: str) -> None:
        with lines.open("a") as file:
            file.write(line + "\n")

    def abort(code: int) -> None:
        report(f"ABORT {code}")
        os._exit(code)

    heartbeat = Heartbeat(stale_s=1.0, interval_s=0.5, abort_s=3.0, report=report, abort=abort)
    heartbeat.start()
    tensor = torch.ones(4)
    try:
        for step in range(1, 100_000):
            heartbeat.set_step(step)
            report(f"STEP {step}")
            time.sleep(0.05)  # the step's work
            if rank == stall_rank and step == stall_step:
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.all_reduce(tensor)
    except RuntimeError:  # the peer ended the run: gloo's connection reset
        heartbeat.stop()
        report(f"LOST {heartbeat.lost_ranks()}")
    os._exit(0)


def _run_stall(tmp_path: Path, stall_rank: int, stall_step: int = 30) -> tuple[dict[int, str], dict[str, float]]:
    context = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [
        context.Process(target=_stalling_rank, args=(rank, port, tmp_path, stall_rank, stall_step)) for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    waiting, stalled = procs[1 - stall_rank], procs[stall_rank]
    times: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 60
        while (
            not (tmp_path / f"rank{stall_rank}.txt").exists()
            or f"STEP {stall_step}\n" not in (tmp_path / f"rank{stall_rank}.txt").read_text()
        ):
            assert time.monotonic() < deadline, "the ranks did not reach the stall"
            time.sleep(0.05)
        start = time.monotonic()
        waiting.join(timeout=30)
        times["waiting_exit_s"] = time.monotonic() - start
        assert waiting.exitcode is not None, "the waiting rank did not end"
        continued = time.monotonic()
        os.kill(stalled.pid, signal.SIGCONT)
        stalled.join(timeout=30)
        times["stalled_exit_after_cont_s"] = time.monotonic() - continued
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    times["waiting_code"] = float(waiting.exitcode)
    return {r: (tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)}, times


def test_a_rank_stopped_past_the_timeout_ends_the_run_naming_it_and_its_step(tmp_path: Path) -> None:
    # Rank 1 stops itself in step 30; rank 0 (which watches every rank) waits in step 30's all_reduce.
    reports, times = _run_stall(tmp_path, stall_rank=1)
    assert times["waiting_code"] == 4, (times, reports[0])
    assert "ABORT 4" in reports[0] and times["waiting_exit_s"] < 3.0 + 5 * 0.5 + 2, times
    # The step named is the one it stopped in, not the one of its last periodic heartbeat.
    assert "plait: rank 1 has not answered for 1 s (its last heartbeat was at step 30)" in reports[0], reports[0]
    assert "plait: error: rank 1 has not answered for 3 s (in step 30), past strategy.timeout_s=3" in reports[0], (
        reports[0]
    )
    # Continued, the stopped rank finds its peer gone and ends at once.
    assert "LOST [0]" in reports[1] and times["stalled_exit_after_cont_s"] < 5.0, (times, reports[1])


def test_a_stopped_store_host_is_named_by_the_others_and_ends_the_run(tmp_path: Path) -> None:
    # Rank 0 hosts the heartbeat store: rank 1's reads block on it, which its watch thread notices.
    reports, times = _run_stall(tmp_path, stall_rank=0)
    assert times["waiting_code"] == 4 and "ABORT 4" in reports[1], (times, reports[1])
    # Its stopped store answers no more reads: the step is the one rank 1 read last, at rank 1's
    # own step 30 (29 when rank 1 read before rank 0 had published its step 30).
    stall = next(
        line
        for line in reports[1].splitlines()
        if line.startswith("plait: rank 0 (it hosts the heartbeat store) has not")
    )
    assert re.search(r"has not answered for 1 s \(its last heartbeat was at step (29|30)\)", stall), stall
    assert re.search(r"plait: error: rank 0 has not answered for 3 s \(in step (29|30)\)", reports[1]), reports[1]
    assert "LOST [1]" in reports[0] and times["stalled_exit_after_cont_s"] < 5.0, (times, reports[0])


# Slow: CLI runs or waits on timeouts (10-30 s for the file); left out of the default run to keep it
# near 15 min on 2 cores since it runs tests/dist/ (python -m pytest -m slow runs them).
pytestmark = pytest.mark.slow
