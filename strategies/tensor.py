"""Tensor parallelism on the ``tp`` mesh axis, with sequence parallel and loss parallel.

Sources: Shoeybi et al. 2019, "Megatron-LM" (column-wise then row-wise linear pairs: one
all-reduce per pair in forward and one in backward); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (sequence parallelism: the norms and the residual stream
stay sharded on the sequence dimension between blocks, each all-reduce becomes an all-gather before
and a reduce-scatter after the pair). Built on DTensor's public ``parallelize_module`` and
``loss_parallel``.

The model declares its plan (``model.tp_plan(sequence_parallel=..., loss_parallel=...)``, a dict
from module-name patterns to DTensor ``ParallelStyle`` objects); the plugin applies it. To change
the plan, subclass `TensorParallel`, override `plan`, and select the subclass with
``strategy.tensor_parallel._target_=my_pkg.MyTensorParallel``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from strategies.core.model_contract import SIZES, declares, missing
from strategies.core.parallel_dims import LayoutError, Meshes, ParallelDims, divisors
from strategies.plugin import StrategyPlugin
from strategies.transforms.ties import keep_ties

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def tp_divisibility_problems(
    tp: int, *, n_heads: int, n_kv_heads: int, vocab_size: int | None = None, ffn_dim: int | None = None
) -> list[str]:
    """Problems (each naming the fix) of a tensor-parallel degree for a model's sizes; [] if it fits.

    Column-wise q/k/v projections shard whole heads, so tp must divide ``n_heads`` and
    ``n_kv_heads`` (case C18: otherwise attention fails later with a reshape error). The
    vocabulary (row-wise embedding, column-wise LM head, loss parallel) and the SwiGLU width must
    split evenly too.
    """
    problems = []
    if tp <= 1:
        return problems
    if n_heads % tp or n_kv_heads % tp:
        valid = [d for d in divisors(n_heads) if n_kv_heads % d == 0]
        problems.append(
            f"strategy.tp={tp} does not divide n_heads={n_heads} and n_kv_heads={n_kv_heads}; "
            f"valid tp: {', '.join(map(str, valid))}"
        )
    if vocab_size is not None and vocab_size % tp:
        padded = -(-vocab_size // tp) * tp
        problems.append(
            f"strategy.tp={tp} does not divide the vocabulary size {vocab_size} (the embedding and the LM head are "
            f"sharded by vocabulary rows); pad it with +model.vocab_size={padded}"
        )
    if ffn_dim is not None and ffn_dim % tp:
        problems.append(
            f"strategy.tp={tp} does not divide ffn_dim={ffn_dim}; use model.ffn_dim={-(-ffn_dim // tp) * tp}"
        )
    return problems


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Applies ``plan`` to ``model`` in place over ``tp_mesh`` (1-D).

    Weights become DTensors sharded on ``tp_mesh``; a plan key may use ``*`` for one name level
    (``layers.*.attention.wq``). Weights tied before stay tied (`strategies.transforms.ties.keep_ties`): the
    input embedding and the LM head are both sharded by vocabulary rows (``Shard(0)``), so the head
    is pointed back at the sharded embedding weight.

    Raises:
        LayoutError: if ``tp_mesh`` is not 1-D.
        ValueError: the plan lays two tied weights out differently.
    """
    if tp_mesh.ndim != 1:
        raise LayoutError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim}-D")
    with keep_ties(model):  # parallelize_module distributes each module's parameters on their own
        parallelize_module(model, tp_mesh, plan)


@dataclass
class TensorParallel(StrategyPlugin):
    """The tensor-parallel plugin: Megatron column/row-wise linear pairs over the ``tp`` axis.

    Args:
        sequence_parallel: keep norms and the residual stream sharded on the sequence dimension
            (activation memory / tp; all-gather + reduce-scatter instead of all-reduce).
        loss_parallel: compute the cross-entropy on vocabulary-sharded logits ([B, T, V/tp] per
            rank) without gathering them.

    Raises:
        LayoutError: from `apply`, when the model's sizes do not split over the tp degree.
    """

    sequence_parallel: bool = True
    loss_parallel: bool = True

    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        return dims.tp > 1

    def plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        """The module-name -> ``ParallelStyle`` plan for ``model``; override to change it."""
        if not declares(model, "tp_plan"):
            raise LayoutError(
                f"{type(model).__name__} declares no tensor-parallel plan (a tp_plan method); use strategy.tp=1 "
                "or subclass strategies.tensor.TensorParallel and override plan()"
            )
        return model.tp_plan(sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """The model sizes that the tp degree does not divide (heads, kv heads, vocabulary, SwiGLU width),
        and, with sequence parallelism, the tokens of a row on a cp rank (``data.seq_len / cp``: the
        norms and residuals shard them over tp, whose gathers need equal shares)."""
        tp = run.dims.tp
        if tp <= 1:
            return []
        problems = []
        local = run.seq_len // max(run.dims.cp, 1)
        if self.sequence_parallel and run.seq_len and local % tp:
            multiple = tp * max(run.dims.cp, 1) * (2 if run.dims.cp > 1 else 1)  # cp's load balancing cuts 2 cp chunks
            cp = f" / cp={run.dims.cp}" if run.dims.cp > 1 else ""
            problems.append(
                f"data.seq_len={run.seq_len}{cp} = {local} tokens per row are not divisible by strategy.tp={tp} "
                f"(sequence parallelism shards them over tp); use a seq_len that is a multiple of {multiple}, or "
                "strategy.tensor_parallel.sequence_parallel=false"
            )
        if shape is None:
            return problems
        return problems + tp_divisibility_problems(
            tp,
            n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            vocab_size=shape.vocab_size,
            ffn_dim=shape.ffn_dim,
        )

    def apply(self, model: nn.Module, meshes: Meshes) -> None:
        """Checks the sizes and shards ``model`` over ``meshes["tp"]`` in place.

        Raises:
            LayoutError: listing the sizes that tp does not divide, with valid degrees.
        """
        tp_mesh = meshes["tp"]
        if not missing(model, SIZES):  # refused by validate otherwise (strategies.core.model_contract.NEEDS)
            problems = tp_divisibility_problems(
                tp_mesh.size(),
                n_heads=model.n_heads,
                n_kv_heads=model.n_kv_heads,
                vocab_size=model.vocab_size,
                ffn_dim=model.ffn_dim,
            )
            if problems:
                raise LayoutError("\n".join(problems))
        apply_tensor_parallel(model, tp_mesh, self.plan(model))

    def loss_context(self) -> AbstractContextManager[None]:
        """``loss_parallel()`` when enabled (the loss and its backward must run inside it)."""
        return loss_parallel() if self.loss_parallel else nullcontext()
