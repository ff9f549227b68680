"""Helpers shared by the tests: compose a recipe, fit in-process or in forked gloo ranks, run the CLI."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from strategies.runtime.launch import LAUNCH_ENV
from trainer.build import build_run
from trainer.compose import compose
from trainer.objectives.pretrain import CausalLM
from trainer.rundir import RunDir
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
# A mixture of experts of the nano size (width 64, 2 blocks, 4 experts of 32, top-2, one shared
# expert, every block MoE) with all three router mechanisms on.
MOE_SMALL = (
    "model=moe_tiny",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.num_experts=4",
    "model.top_k=2",
    "model.moe_ffn_dim=32",
    "model.n_dense_layers=0",
    "model.num_shared_experts=1",
    "model.balance_coef=0.01",
    "model.z_loss_coef=0.001",
    "model.bias_update_rate=0.01",
    "model.max_seq_len=64",
)


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


def all_stages(trainer: L.Trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every rank's ``tensors`` under pipeline parallelism (each stage holds other
    parameters); ``tensors`` itself otherwise."""
    if trainer.strategy.dims.pp == 1:
        return tensors
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensors)
    return {name: t for part in gathered for name, t in part.items()}


class GradRecorder(L.Callback):
    """Appends ``{"step": k, "grads": {name: full gradient}}`` to the Task's history before each
    optimizer step (after clipping). Add with ``+callbacks.grads._target_=harness.GradRecorder``."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = {n: full(p.grad).detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}
        pl_module.history.append({"step": trainer.global_step + 1, "grads": all_stages(trainer, grads)})


class ParamRecorder(L.Callback):
    """Appends ``{"params": {name: full parameter}}`` at the end of training.
    Add with ``+callbacks.params._target_=harness.ParamRecorder``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        params = {n: full(p.data).detach().clone() for n, p in pl_module.model.named_parameters()}
        pl_module.history.append({"params": all_stages(trainer, params)})


class RowRecorder(L.Callback):
    """Appends ``{"rows": this rank's input_ids of the step}`` at every training batch (rank 0's in
    the history). Add with ``+callbacks.rows._target_=harness.RowRecorder``."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pl_module.history.append({"rows": batch["input_ids"].detach().clone()})


class InitialParamRecorder(L.Callback):
    """Appends ``{"initial_params": {name: full parameter}}`` at the start of training.
    Add with ``+callbacks.initial_params._target_=harness.InitialParamRecorder``."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        params = {n: full(p.data).detach().clone() for n, p in pl_module.model.named_parameters()}
        pl_module.history.append({"initial_params": all_stages(trainer, params)})


class TieRecorder(L.Callback):
    """Appends ``{"ties": [per rank: {"one_tensor", "equal", "embedding"}]}`` at the end of training:
    whether the LM head is the input embedding's tensor (``is``), whether their full tensors are
    bitwise equal, and the full embedding, gathered from every rank (world group; not under pp).
    Add with ``+callbacks.ties._target_=harness.TieRecorder``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        import torch.distributed as dist

        model = pl_module.model
        embedding, head = full(model.tok_embeddings.weight.data), full(model.output.weight.data)
        mine = {
            "one_tensor": model.output.weight is model.tok_embeddings.weight,
            "equal": torch.equal(embedding, head),
            "embedding": embedding.detach().clone(),
        }
        ranks: list[Any] = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        pl_module.history.append({"ties": ranks})


class OffloadRecorder(L.Callback):
    """Appends ``{"offload": sorted reprs of the FSDP modules' offload policies}`` at the start of
    training (torch 2.13's FSDP2 keeps it on the module's param group, a private attribute).
    Add with ``+callbacks.offload._target_=harness.OffloadRecorder``."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        groups = [m._get_fsdp_state()._fsdp_param_group for m in pl_module.model.modules() if isinstance(m, FSDPModule)]
        pl_module.history.append({"offload": sorted({repr(g.offload_policy) for g in groups if g is not None})})


class StageLayers(L.Callback):
    """Appends ``{"layers": [block keys this rank holds]}`` at the end of training (rank 0's: its
    pipeline stages). Add with ``+callbacks.layers._target_=harness.StageLayers``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.history.append({"layers": sorted(pl_module.model.layers, key=int)})


class SleepPerStep(L.Callback):
    """Sleeps ``seconds`` after every training batch: a known lower bound on a run's training wall time."""

    def __init__(self, seconds: float = 0.25) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:  # noqa: D102
        time.sleep(self.seconds)


class WholeLossSums(CausalLM):
    """plait's `CausalLM` that also reports its whole loss as one named sum, ``loss/all`` (the
    summed token loss and the supervised tokens of every micro-batch), so that a layout's
    ``train/loss/all`` can be checked against its ``train/loss``: a named sum reduced over fewer
    ranks (or worlds) than the loss shows up as a difference. Use with
    ``objective._target_=harness.WholeLossSums``."""

    def __init__(self, loss_chunk_tokens: int | None = None) -> None:
        super().__init__(loss_chunk_tokens)
        self._sums: torch.Tensor | None = None

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # noqa: D102
        loss = super().loss_sum(model, batch)
        sums = torch.stack([loss.detach().float(), self.num_tokens(batch).to(loss.device)]).reshape(2, 1)
        self._sums = sums if self._sums is None else self._sums + sums
        return loss

    def pop_sums(self) -> tuple[list[str], torch.Tensor]:  # noqa: D102
        sums, self._sums = self._sums, None
        return ["loss/all"], sums if sums is not None else torch.zeros(2, 1)


class DiskFullAt(L.Callback):
    """From optimizer step ``step`` on, the disk is full: every file DCP writes (a checkpoint's
    shards and ``.metadata``) raises ``OSError(ENOSPC)`` after its first ``room`` bytes, as a real
    disk does in the middle of a file. Add with ``+callbacks.full._target_=harness.DiskFullAt``."""

    def __init__(self, step: int, room: int = 4096) -> None:
        self.step, self.room = step, room

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:  # noqa: D102
        if trainer.global_step != self.step:
            return
        import errno
        from contextlib import contextmanager

        from torch.distributed.checkpoint.filesystem import FileSystem

        room, real = self.room, FileSystem.create_stream

        class Filling:
            def __init__(self, stream: Any, path: Any) -> None:
                self.stream, self.path, self.left = stream, path, room

            def write(self, data: Any) -> int:
                if len(data) > self.left:
                    self.stream.write(bytes(data)[: self.left])
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                self.left -= len(data)
                return self.stream.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.stream, name)

        @contextmanager
        def create_stream(fs: Any, path: Any, mode: str) -> Any:
            with real(fs, path, mode) as stream:
                yield Filling(stream, path) if "w" in mode else stream

        FileSystem.create_stream = create_stream  # the checkpoint callback runs after this one


# For a CLI subprocess that names a harness callback (``+callbacks.x._target_=harness.SleepPerStep``).
def env_with_tests() -> dict[str, str]:
    """This process' environment with tests/ first on PYTHONPATH (and no empty entry, which Python
    reads as the current folder)."""
    paths = [str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def losses(history: list[dict[str, Any]]) -> list[float]:
    return [h["loss"] for h in history if "loss" in h]


def reference_setup(
    cfg: DictConfig, *, edit: Callable[[torch.nn.Module], None] | None = None
) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, Any]:
    """The pieces of a plain one-process reference loop for ``cfg`` (SGD with momentum):
    ``(train rows, model with plait's initial weights, optimizer, global-batch sampler at dp=1)``.
    Iterate the sampler for each step's row indices. ``edit`` changes the model in place before
    the optimizer takes its parameters (a test's own tie, say)."""
    from trainer.build import build_data
    from trainer.data.sampler import GlobalBatchSampler
    from trainer.model_node import instantiate_model

    prepared = build_data(cfg).prepare()
    torch.manual_seed(cfg.seed)
    model = instantiate_model(cfg.model, vocab_size=prepared.tokenizer.vocab_size)
    if edit is not None:
        edit(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    sampler = GlobalBatchSampler(
        len(prepared.train),
        global_batch_size=cfg.train.global_batch_size,
        dp_size=1,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
        drop_last=cfg.data.drop_last,
    )
    return prepared.train, model, optimizer, sampler


def reference_run(
    cfg: DictConfig, steps: int, *, edit: Callable[[torch.nn.Module], None] | None = None
) -> dict[str, Any]:
    """A plain one-process loop of ``steps`` steps (`reference_setup`, which applies ``edit``): one
    forward of each step's rows, token-sum cross-entropy over the supervised tokens / their count,
    backward, SGD step.

    Returns:
        ``{"loss": [float per step], "grads": [{name: grad} per step], "params": {name: after}}``.
    """
    import torch.nn.functional as F

    from trainer.data.packing import IGNORE_INDEX

    rows, model, optimizer, sampler = reference_setup(cfg, edit=edit)
    out: dict[str, Any] = {"loss": [], "grads": []}
    for _, index in zip(range(steps), sampler):
        labels = rows.labels[index]
        logits = model(
            rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
        )
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def recorded(history: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's per-step losses and gradients and its final parameters (logged by `GradRecorder`
    and `ParamRecorder`), in `reference_run`'s layout: ``{"loss", "grads", "params"}``."""
    return {
        "loss": losses(history),
        "grads": [h["grads"] for h in history if "grads" in h],
        "params": [h["params"] for h in history if "params" in h][0],
    }


def assert_equals_reference(history: list[dict[str, Any]], ref: dict[str, Any], steps: int, **tol: float) -> None:
    """A run's per-step losses and gradients, and its parameters after ``steps`` steps (`recorded`),
    equal `reference_run`'s within ``tol`` (``atol``/``rtol``)."""
    run = recorded(history)
    assert len(run["loss"]) == len(run["grads"]) == steps
    for step in range(steps):
        torch.testing.assert_close(run["loss"][step], ref["loss"][step], **tol, msg=f"loss at step {step + 1}")
        torch.testing.assert_close(run["grads"][step], ref["grads"][step], **tol, msg=f"grads at step {step + 1}")
    torch.testing.assert_close(run["params"], ref["params"], **tol, msg=f"parameters after {steps} steps")


# Plain SGD at a constant LR without clipping: every layout applies its own gradient, so parameters
# after a few steps (with momentum) compare layouts exactly.
EXACT_SGD = ("optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0")

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
    with open(RunDir(run_dir).metrics, newline="") as file:
        return {int(row["step"]): row for row in csv.DictReader(file) if row.get("train/loss")}


def assert_resumed_bit_exact(
    run_dir: Path, straight: Path, run_args: Sequence[str], *, resumed_from: int
) -> subprocess.CompletedProcess[str]:
    """``plait *run_args run_dir=<run_dir> resume=last`` succeeds, and its steps after ``resumed_from``
    equal the uninterrupted run ``straight``'s bitwise (loss, grad norm, lr per step; summary's
    tokens and final validation loss); steps up to ``resumed_from`` were trained once, not again.
    Returns the resumed run's result (its stderr for the caller's own checks)."""
    result = plait(*run_args, f"run_dir={run_dir}", "resume=last")
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    reference, resumed = train_rows(straight), train_rows(run_dir)
    assert sorted(resumed) == sorted(reference), (sorted(resumed), sorted(reference))
    for row in range(resumed_from + 1, max(reference) + 1):  # row k holds optimizer step k
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert resumed[row][key] == reference[row][key], (row, key, resumed[row][key], reference[row][key])
    with open(RunDir(run_dir).metrics, newline="") as file:
        first_steps = [row for row in csv.DictReader(file) if row["step"] == "1" and row["train/loss"]]
    assert len(first_steps) == 1, first_steps
    summary, expected = (json.loads(RunDir(p).summary.read_text()) for p in (run_dir, straight))
    for key in ("steps", "tokens_seen", "final_val_loss"):
        assert summary[key] == expected[key], (key, summary[key], expected[key])
    return result


class SatRates(L.Callback):
    """Appends ``{"sat": (step, the SAT plugin's omission rate at it)}`` at every training batch's
    start, as the plugin computes it in the run (its ladder spans the steps it was told).
    Add with ``+callbacks.sat_rates._target_=harness.SatRates``."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        pl_module.history.append({"sat": (step, trainer.strategy.plugins["sat"].rate_at(step))})
