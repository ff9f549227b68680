"""Run a function in N forked processes of one gloo process group (CPU tests and benchmarks).

For code below the trainer (collectives, sharding, memory accounting) without Lightning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist


def run_gloo_ranks(world_size: int, fn: Callable[[int], Any], *, timeout_s: float = 60.0) -> list[Any]:
    """Runs ``fn(rank)`` in ``world_size`` forked processes of one gloo group; returns the results by rank.

    For tests of collectives below the trainer (no Lightning). Each rank reports its result (or
    its traceback) through a queue before it exits, and leaves with ``os._exit`` after
    ``destroy_process_group`` (about 1 in 30 gloo processes aborts at interpreter exit on torch 2.13 CPU).

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or did not finish in time.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    init_file = tempfile.NamedTemporaryFile(prefix="plait-gloo-", delete=False).name

    def worker(rank: int) -> None:
        code = 0
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            results.put((rank, True, fn(rank)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            results.put((rank, False, traceback.format_exc()))
            code = 1
        finally:
            results.close()
            results.join_thread()  # flush the queue's feeder thread: os._exit would drop the result
            if dist.is_initialized():
                dist.destroy_process_group()
            os._exit(code)

    procs = [ctx.Process(target=worker, args=(rank,)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            by_rank[rank] = value
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(by_rank))
        raise RuntimeError(f"ranks {missing} gave no result in {timeout_s} s") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        Path(init_file).unlink(missing_ok=True)  # the FileStore may have removed it
    return [by_rank[rank] for rank in range(world_size)]
