"""What `trainer.task.Task` needs from the objects it drives, as `typing.Protocol` classes.

A class of yours implements one by having its methods (select it with ``_target_``); plait's own
classes subclass the protocol to inherit the optional hooks' defaults. The Task calls exactly
these, and nothing it does not declare here (Lightning's ``Strategy`` base class is the model of
such a declared contract).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, runtime_checkable

import lightning as L
import torch
from torch import nn

from strategies.core.parallel_dims import ParallelDims
from strategies.core.resolved import ResolvedRun

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

# What one row of a data module's batches is (`DataModule.row_kind_of`) and what an objective trains
# on (`Objective.row_kind`): "tokens" (packed token rows: text, chat), "pairs" (preference pairs,
# ``[P, 2, T]``), "unpaired" (labelled completions with a mismatched row each, laid out as pairs) or
# "prompts" (prompt indices whose rows an online objective samples from the policy: `Objective.step_rows`).
RowKind = Literal["tokens", "pairs", "unpaired", "prompts"]
ROW_NOUNS: dict[str, str] = {
    "tokens": "token rows", "pairs": "preference pairs", "unpaired": "unpaired rows", "prompts": "prompts"
}  # fmt: skip


class Component(Protocol):
    """What `trainer.config.validate` asks of each component a config selects with ``_target_`` (the
    objective, the data module, the evaluators the data module builds): its own problems, before any
    process starts. The strategy's plugins have theirs too, on the model's shape (`strategies.plugin`).
    """

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """Messages, each naming the fix, of what this component cannot run in ``run``; [] when it fits.

        Args:
            run: the resolved run (degrees, micro-batches, the data's row kind, the model's shape,
                ...); None when the layout itself did not resolve (its problems are reported
                already): check what needs no layout.
            node: this component's own config node (``cfg.objective``, ``cfg.data``); read other
                groups only through ``run`` (a rule between groups belongs in `trainer.semantics`).
        """
        return []


class Strategy(Protocol):
    """The parallel parts of a step (`strategies.mesh.MeshStrategy` implements them)."""

    dims: ParallelDims  # the resolved degrees (after setup)
    token_axis: str  # the mesh view whose ranks count a step's supervised tokens together

    def parallelize(self, model: nn.Module) -> None:
        """Applies the layout to ``model`` in place (`Task.configure_model`, once)."""
        ...

    def shard_batch(self, batch: Batch) -> Batch:
        """This rank's part of its dp rows (e.g. its cp slice of the sequence)."""
        ...

    def micro_batches(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        """This rank's micro-batches of its dp rows for one step (its part, `shard_batch`, in runs of
        ``micro_batch_size`` rows; a layout may place rows otherwise, e.g. cp hybrid placement)."""
        ...

    def forward_backward(
        self,
        model: nn.Module,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; the 0-dim sum of their losses (detached)."""
        ...

    def eval_loss_sum(self, model: nn.Module, batch: Batch, loss_sum: LossFn) -> torch.Tensor:
        """Summed loss of one evaluation batch, without gradients."""
        ...

    def loss_context(self) -> AbstractContextManager[None]:
        """The context the loss and its backward run in (loss parallel under tp)."""
        ...

    def whole_rows(self) -> AbstractContextManager[None]:
        """The context whose forwards see whole rows on this rank (cp > 1: preference pairs are
        never split); a no-op without cp. Entered around the forward of ``[B, 2, T]`` pairs."""
        ...

    def grad_norm(self, parameters: Sequence[nn.Parameter]) -> torch.Tensor:
        """The global gradient norm, equal on every rank."""
        ...

    def clip_grads(self, parameters: Sequence[nn.Parameter], *, max_norm: float, total_norm: torch.Tensor) -> None: ...

    def after_optimizer_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Work after each optimizer step (local-SGD synchronisation); metrics for the loggers."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor, axis: str = "dp_cp") -> torch.Tensor:
        """In-place SUM over one mesh axis or view; returns ``tensor``."""
        ...


class Objective(Component, Protocol):
    """A training objective (`trainer.objectives`): the Task divides `loss_sum` by the step's
    global `num_tokens`, so micro-batches and ranks add up to one big batch.

    It holds no state a checkpoint needs (a preference objective's reference log-probs live in the
    data module, whose ``state_dict`` the checkpoint keeps). An online objective keeps its rollout's
    rows for the steps that reuse them (`step_rows`); they are sampled again on resume.
    """

    # What `num_tokens` counts: "tokens" (the loss is a mean negative log-likelihood per token, so
    # exp of the validation loss is a perplexity, logged as val/ppl) or "pairs" (a preference loss).
    count_unit: str = "tokens"
    # What `num_tokens` counts on a training step (the step's loss divisor), logged as ``train/<name>``.
    step_count_name: str = "supervised_tokens"
    # Names of `pop_sums` whose held-out means (``val/<name>``) measure whether the recipe learns,
    # beyond the loss (a preference objective's reward accuracy and margin): ``summary.json``'s
    # ``first_val_metrics`` / ``final_val_metrics`` and ``plait compare`` show them.
    headline_metrics: tuple[str, ...] = ()
    # The rows it trains on: `problems` refuses a data module whose `DataModule.row_kind_of` differs.
    row_kind: RowKind = "tokens"

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """`Component.problems`; here: data whose rows are not this objective's `row_kind` (an
        override should keep it: ``super().problems(run, node)``)."""
        if run is None or run.row_kind is None or run.row_kind == cls.row_kind:
            return []
        need, given = ROW_NOUNS.get(cls.row_kind, cls.row_kind), ROW_NOUNS.get(run.row_kind, run.row_kind)
        return [
            f"objective {cls.__name__} trains on {need}, but the data module gives {given}; use a data group of "
            f"{need} (`plait <recipe> --help` lists each group's choices)"
        ]

    def step_rows(self, task: L.LightningModule, batch: Batch) -> Batch:
        """The rows this rank trains on this step, made from the loader's ``batch`` (on the device):
        the batch itself for an objective of a fixed dataset; an online objective (GRPO,
        `trainer.objectives.grpo`) samples them from the policy here, after the previous step's
        update (the loader runs a batch ahead, so it cannot)."""
        return batch

    def num_tokens(self, batch: Batch) -> torch.Tensor:
        """The units ``batch``'s loss is averaged over (supervised tokens, pairs); 0-dim fp32."""
        ...

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The summed loss of ``batch`` under ``model``; 0-dim fp32."""
        ...

    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """Named sums since the last call: ``(names, [2, K] tensor)``, row 0 the sums, row 1 their
        counts (this rank's share). The Task reduces them over dp x cp and logs
        ``{train|val}/<name>`` = sum / count where the count is > 0. None: nothing to report."""
        return None

    def before_fit(self, task: L.LightningModule) -> None:
        """Runs on every rank after the model is parallelized, before the first step (e.g. the
        reference log-probs of a preference objective); a restored run may skip its work.

        Args:
            task: the `trainer.task.Task` (its model, trainer, strategy, datamodule, micro_batch_size).
        """
        return None


@runtime_checkable
class RoutedModel(Protocol):
    """A model with routed layers (a mixture of experts, `trainer.models.moe_transformer`): its
    router losses are injected in backward, so the Task gives it the step's normalisation, and it
    sums statistics (expert loads, balance loss) the Task logs like the objective's."""

    def set_router_loss_scale(self, scale: float) -> None:
        """Before the step's forward/backward: 1 / the routed tokens of the step over the token axis."""
        ...

    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """Names and a [2, K] tensor (sums, counts) since the last call, as `Objective.pop_sums`;
        summed over pipeline stages too, so every stage returns the same names (None on all or none)."""
        ...


class Loader(Protocol):
    """The train loader the data module returns (its position is checkpointed)."""

    exhausted: bool  # finite data has ended: the run stops after this step

    def __iter__(self) -> Iterator[Batch]: ...

    def mark_trained(self) -> dict[str, float] | None:
        """After each optimizer step: the rows just trained are consumed; data metrics, if any."""
        ...


class Evaluator(Component, Protocol):
    """Scores the model beyond the loss at each evaluation (e.g. held-out exact match). Its
    `problems` get the node of the data module that builds it (`DataModule.evaluator_types`)."""

    @property
    def headline_metrics(self) -> Sequence[str]:
        """Full names of the metrics of `evaluate` that measure whether the recipe learns
        (``summary.json`` and ``plait compare`` show them; see `Objective.headline_metrics`)."""
        ...

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics by full name (``val/exact_match/<source>``); runs on every rank, in eval mode,
        without gradients, inside the precision's forward context."""
        ...


class DataModule(Component, Protocol):
    """What the Task asks of the data module, besides Lightning's ``train_dataloader``, and what
    validate asks of its class (`problems`, `row_kind_of`, `evaluator_types`)."""

    row_kind: RowKind = "tokens"  # what its batches hold (see `RowKind`)

    @classmethod
    def row_kind_of(cls, node: Any) -> RowKind:
        """The row kind a data node of this class gives (a setting may choose it, e.g. ``unpaired``)."""
        return cls.row_kind

    @classmethod
    def evaluator_types(cls, node: Any) -> list[type[Evaluator]]:
        """The classes of the evaluators a data node of this class builds (`evaluators`); validate
        asks each for its `problems` with ``node``."""
        return []

    def eval_dataloader(self) -> Iterable[Batch]: ...

    def finite_steps(self) -> int | None:
        """Optimizer steps until the data ends (budgets of an SFT mixture); None: endless."""
        ...

    def end_reason(self, steps: int) -> str:
        """Why the data ends after ``steps`` and the setting that lengthens the run, e.g.
        ``data.sources.mine is spent after max_epochs=1.0 (5 steps); raise +data.sources.mine.max_epochs``;
        asked at launch for `finite_steps` (`trainer.run_length`), or when data of unknown length ends."""
        ...

    def evaluators(self) -> list[Evaluator]:
        """The evaluators of this data ([] for none)."""
        ...

    def data_counts(self) -> dict[str, Any]:
        """Per source, what preparation cut from the training samples (`trainer.data.accounting.SourceCounts`)."""
        ...

    def held_out_counts(self) -> dict[str, Any]:
        """Per source, what preparation cut from the held-out samples (`trainer.data.accounting.SourceCounts`)."""
        ...

    def data_fingerprint(self) -> str | None:
        """A hash of the prepared data (a resume refuses data other than its checkpoint's, `trainer.resume`);
        None: not known (not compared)."""
        return None
