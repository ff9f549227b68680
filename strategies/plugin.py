"""`StrategyPlugin`: the one contract every technique plugin of `strategies.mesh.MeshStrategy` implements.

A plugin is its file plus a node under ``strategy:`` (any key whose value has a ``_target_`` that
builds a `StrategyPlugin`). `MeshStrategy` holds the configured plugins in its ``ORDER`` and calls
each phase below on the plugins the layout activates, in that order; every hook defaults to
nothing, so a plugin overrides only the phases it takes part in.

Phases, in the order a run meets them:

1. ``problems(run, shape)``: at validate, before any process starts, on every configured plugin
   (active or not: a setting can be wrong for the layout that leaves its plugin off).
2. ``active(dims, islands=...)``: whether the resolved layout applies the plugin at all.
3. ``apply(model, meshes)`` with ``when = "parallelize"`` (in ``Task.configure_model``, the plugins
   in ORDER; ``needs_real_weights`` materializes the model first, ``splits_stages`` returns the
   pipeline stage roots, ``per_stage`` is applied to each of them) or ``when = "setup"`` (after the
   model is on its device and ``model.init_from`` is loaded, before a resumed checkpoint).
4. Per optimizer step: ``place`` (this rank's micro-batches; the first plugin that returns them
   wins), ``step_context(step)`` around the whole forward/backward, ``run_micro_batches`` (a
   plugin that runs the micro-batches itself, e.g. a pipeline schedule; else the strategy's loop),
   per micro-batch ``loss_context()`` and ``micro_batch_context(micro_batch)``, then after the
   optimizer step ``observe_loss(step, loss)`` and ``after_step(model, step, optimizer)`` -> metrics.
5. Evaluation: ``shard(batch, meshes)``, then ``eval_loss_sum`` (or the plain loss) inside
   ``loss_context()`` and, for preference pairs, ``whole_rows()``.
6. Checkpoints: ``checkpoint_io()`` (a plugin that writes and reads the checkpoint itself),
   ``saved_keys()`` (which model keys a checkpoint holds) and ``after_load(model)`` (after a
   checkpoint's weights are loaded into the live model: a resume, a non-finite rollback).

A plugin that joins this world to others (torchft's replica groups, `strategies.fault_tolerance`)
also takes ``data_share()`` (this world's share of each global batch), ``join(trainer)`` (at the
start of training, before the first batch is read), ``reduce_tokens(num_tokens)`` (before the
forward), ``reduce_gradients(parameters, loss, sums)`` (after the backward, before the gradient norm and
the optimizer step) and ``teardown()``.

Declared properties (class attributes): ``when``, ``needs_real_weights``, ``splits_stages``,
``per_stage``, ``after_others`` (its ``after_step`` runs after every other plugin's), ``islands`` (the plugin owns the dp_replicate axis: replicas do not reduce
gradients together, so FSDP and the token count stay inside one island), ``conflicts`` (node keys
of plugins this one does not compose with yet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from strategies.checkpoint.async_save import AsyncWriter
from strategies.core.parallel_dims import Meshes, ParallelDims
from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.runtime.terminal import write_line

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class CheckpointIO(Protocol):
    """A plugin's own checkpoint format (local SGD keeps each island's state and its own)."""

    def save_checkpoint(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        meta: dict[str, Any],
        writer: AsyncWriter | None = None,
    ) -> None: ...

    def load_checkpoint(
        self, path: Path, *, model: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any]: ...


class StrategyPlugin:
    """Base of every technique plugin; each hook is optional and does nothing by default (see the
    module docstring for the phase order)."""

    when: ClassVar[Literal["parallelize", "setup"]] = "parallelize"
    needs_real_weights: ClassVar[bool] = False  # apply on materialized weights (LoRA's adapters beside the base)
    splits_stages: ClassVar[bool] = False  # apply returns the model's stage roots (pipeline parallelism)
    per_stage: ClassVar[bool] = False  # applied to each stage root, not the model (FSDP: each stage its own root)
    islands: ClassVar[bool] = False  # owns the dp_replicate axis (local SGD)
    # its after_step reads the weights every other plugin's after_step may still change (float8's scales
    # after local SGD's averages): it runs after them
    after_others: ClassVar[bool] = False
    conflicts: ClassVar[tuple[str, ...]] = ()  # node keys of plugins it does not compose with yet

    def peers(self, plugins: dict[str, StrategyPlugin]) -> None:
        """Sees the strategy's other configured plugins (by node key) once, when the strategy is
        built: a plugin that works with another (replica groups carrying local SGD's averages) binds
        to it here. Default: nothing."""

    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        """Whether a layout of resolved ``dims`` applies this plugin (``islands``: a plugin of the run
        owns the dp_replicate axis). Default: always (a plugin that is off does nothing in its hooks)."""
        return True

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Messages (each naming the fix) of what in ``run`` / ``shape`` this plugin cannot run; [] if it fits."""
        return []

    def notes(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Warnings for the launch (each naming the fix): settings that run but do nothing at this layout."""
        return []

    def apply(self, model: nn.Module, meshes: Meshes) -> Any:
        """Applies the technique to ``model`` in place (at ``when``); a ``splits_stages`` plugin returns the stage roots."""
        return None

    def shard(self, batch: Batch, meshes: Meshes) -> Batch:
        """This rank's part of an evaluation batch of its dp rows (context parallelism: its cp slice)."""
        return batch

    def place(self, batch: Batch, micro_batch_size: int, meshes: Meshes) -> list[Batch] | None:
        """This rank's micro-batches of its dp rows for one step; None: not this plugin's to place."""
        return None

    def step_context(self, step: int) -> AbstractContextManager[None]:
        """Context around the forward and backward of optimizer step ``step`` (0-based global step)."""
        return nullcontext()

    def loss_context(self) -> AbstractContextManager[None]:
        """Context the loss and its backward run in (loss parallel)."""
        return nullcontext()

    @contextmanager
    def micro_batch_context(self, micro_batch: Batch) -> Iterator[Batch]:
        """Context of one training micro-batch's forward and backward; yields the rows to run."""
        yield micro_batch

    def whole_rows(self) -> AbstractContextManager[None]:
        """Context whose forwards see whole rows on this rank (preference pairs are never split)."""
        return nullcontext()

    def run_micro_batches(self, micro_batches: Sequence[Batch], loss_fn: LossFn) -> torch.Tensor | None:
        """Forward and backward of the step's micro-batches when this plugin runs them itself
        (0-dim sum of their losses); None: the strategy's loop runs them."""
        return None

    def eval_loss_sum(self, batch: Batch, loss_sum: LossFn) -> torch.Tensor | None:
        """Summed loss of one evaluation batch when this plugin runs the forward itself; None: the plain forward."""
        return None

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """The training loss of optimizer step ``step`` (0-dim, on the device: the token-weighted mean
        over every rank and island, the same value on every rank), before `after_step` (DASO's plateau test)."""

    def say(self, line: str | None) -> None:
        """Prints ``plait: <line>`` once, on global rank 0 (None: nothing)."""
        if line is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_line(f"plait: {line}")

    def run_length(self, total_steps: int) -> None:
        """The run's planned optimizer steps, told once before training as the LR schedule gets them
        (`trainer.task.Task.total_steps`: ``trainer.max_steps``, or fewer when the data ends first);
        a plugin whose schedule spans the run (SAT's ladder, DASO's cool-down) takes them here."""

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Work after optimizer step ``step`` (1 after the first; ``optimizer`` unwrapped); metrics for the loggers."""
        return {}

    def after_load(self, model: nn.Module) -> None:
        """After a checkpoint's weights are loaded into the live ``model`` (a resume, a rollback):
        state derived from the weights (float8's precomputed scales) is derived again."""

    def data_share(self) -> tuple[int, int]:
        """``(index, count)``: this world's place among the worlds that split each global batch
        (replica groups); (0, 1): the world trains the whole batch."""
        return 0, 1

    def join(self, trainer: Any) -> None:
        """At the start of training, before the first batch is read (``trainer``: Lightning's): join
        the worlds this one trains with, possibly taking their state (replica groups)."""

    def reduce_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor | None:
        """Before the forward: this world's supervised tokens of the step (0-dim) summed with other
        worlds' (replica groups). None: not this plugin's to reduce."""
        return None

    def reduce_gradients(
        self, parameters: Sequence[nn.Parameter], loss: torch.Tensor, sums: Sequence[torch.Tensor] = ()
    ) -> tuple[torch.Tensor, bool] | None:
        """After the backward: sums this world's gradients (already divided by every world's tokens)
        and the step's named ``sums`` (the objective's ``[2, n]`` sums and counts, e.g. the loss per
        SFT source) with other worlds' in place, and its ``loss``; returns the summed loss and
        whether to apply the update. None: not this plugin's to reduce."""
        return None

    def teardown(self) -> None:
        """At the end of the run, before the process group is destroyed."""

    def end_training(self, model: nn.Module) -> None:
        """Training ends after this step (``trainer.max_steps`` reached or the data ended), before
        the last evaluation, checkpoint and export: leave ``model`` whole (IST reassembles its subnets)."""

    def checkpoint_io(self) -> CheckpointIO | None:
        """The object that writes and reads checkpoints instead of `strategies.checkpoint.dcp`; None: the default."""
        return None

    def saved_keys(self) -> Callable[[str], bool] | None:
        """Which model state keys a checkpoint holds; None: all of them."""
        return None
