"""Helpers shared by the tests: compose a recipe, fit in-process or in forked gloo ranks, run the CLI."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from strategies.launch import LAUNCH_ENV
from trainer.build import build_run
from trainer.cli import compose
from trainer.task import Task

# A model and run small enough for a 2-core machine: 2 blocks of width 64, 64-token rows.
_SMALL = (
    "model=nano",
    "data.seq_len=64",
    "data.eval_rows=8",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "strategy.timeout_s=120",
)
TINY = (*_SMALL, "trainer.max_steps=3", "logger=none", "~callbacks.plots")


def compose_config(overrides: Sequence[str] = (), recipe: str = "pretrain", tiny: bool = True) -> DictConfig:
    """The composed recipe, with the TINY overrides first when ``tiny``."""
    return compose(recipe, [*(TINY if tiny else ()), *overrides])


def fit(cfg: DictConfig, run_dir: Path, *, ckpt_path: str | None = None) -> tuple[L.Trainer, Task]:
    """Builds and fits ``cfg`` in forked ranks (one fork even for devices=1).

    Forking keeps the pytest process free of process groups and gloo threads, which would make
    later forks hang. Afterwards ``task.history`` holds rank 0's history.
    """
    trainer, task, data = build_run(cfg, Path(run_dir), launcher="fork")
    try:
        trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    finally:
        for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
            os.environ.pop(key, None)
    return trainer, task


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class GradRecorder(L.Callback):
    """Appends ``{"step": k, "grads": {name: full gradient}}`` to the Task's history before each
    optimizer step (after clipping). Add with ``+callbacks.grads._target_=harness.GradRecorder``."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = {n: full(p.grad).detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}
        pl_module.history.append({"step": trainer.global_step + 1, "grads": grads})


class ParamRecorder(L.Callback):
    """Appends ``{"params": {name: full parameter}}`` at the end of training.
    Add with ``+callbacks.params._target_=harness.ParamRecorder``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        params = {n: full(p.data).detach().clone() for n, p in pl_module.model.named_parameters()}
        pl_module.history.append({"params": params})


def losses(history: list[dict[str, Any]]) -> list[float]:
    return [h["loss"] for h in history if "loss" in h]


# The CLI's tiny settings: like TINY, but the run directory keeps its csv logger and loss plot.
CLI_TINY = (*_SMALL, "trainer.max_steps=4")


def plait(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Runs ``plait *args`` in a subprocess, never in-process (Lightning's launcher re-runs sys.argv)."""
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    """metrics.csv rows with a train loss, by their ``step`` column; the last row wins (a resumed
    run appends the steps it repeats). Row k holds optimizer step k (row 0: validation before training)."""
    with open(Path(run_dir) / "metrics.csv", newline="") as file:
        return {int(row["step"]): row for row in csv.DictReader(file) if row.get("train/loss")}


def run_gloo_ranks(world_size: int, fn: Callable[[int], Any], *, timeout_s: float = 60.0) -> list[Any]:
    """Runs ``fn(rank)`` in ``world_size`` forked processes of one gloo group; returns the results by rank.

    For tests of collectives below the trainer (no Lightning). Each rank reports its result (or
    its traceback) through a queue before it exits, and leaves with ``os._exit`` after
    ``destroy_process_group`` (gloo's rare abort at interpreter exit, research/cpu_feasibility.md).

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or did not finish in time.
    """
    import multiprocessing as mp
    import queue
    import tempfile
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    init_file = tempfile.NamedTemporaryFile(prefix="plait-gloo-", delete=False).name

    def worker(rank: int) -> None:
        code = 0
        try:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
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
