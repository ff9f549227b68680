"""A stopped rank is named by the rank waiting for it (with its step) while it is stopped, again
when it answers, and as lost after it is killed (gloo processes with the heartbeat thread)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from strategies.watchdog import Heartbeat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: Path) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
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
