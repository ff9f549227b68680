"""Context parallelism on the ``cp`` mesh axis: ring, Ulysses and hybrid (head x context) attention.

Sources: Liu et al. 2023, "Ring Attention" (k/v blocks around a ring, see `strategies.context.ring.ring_attention`);
Jacobs et al. 2023, "DeepSpeed Ulysses" (all-to-all from sequence sharding to head sharding around
attention, and back); Gu et al. 2024, "LoongTrain" (2-D head x context parallelism: Ulysses inside
a group of ranks, ring attention across groups); the zigzag load balancing of causal attention
(each rank holds one chunk from the head and the mirrored chunk from the tail of the sequence;
Brandon et al. 2023, "Striped Attention", discuss the imbalance).

Every cp rank keeps ``T/cp`` tokens of each row (`strategies.context.sharding.shard_batch`, before the step counts supervised
tokens: the Task sums the counts over dp x cp, so a shard without supervised tokens adds exactly 0,
case C03). Between attentions nothing needs the other shards: embeddings, norms, MLP and the loss
are per token. Attention is replaced per module by `strategies.context.attention.ContextParallelAttention`, which knows the
global position and document id of every token, so packed rows stay block-diagonal causal when a
document straddles shards. Parameters are the same on every cp rank; FSDP shards them over
dp_shard x cp and sums their gradients there (`MeshStrategy.dp_mesh`).

Modes (``strategy.context_parallel.mode``): ``ring`` (ring over all cp ranks), ``ulysses`` (all-to-all over all cp
ranks; needs heads and kv heads per tp rank divisible by cp) and ``hybrid`` (``ulysses_degree``
ranks per head group, ``cp / ulysses_degree`` groups in a ring). Rank ``c`` of a cp group has ring
index ``c // ulysses_degree`` and Ulysses index ``c % ulysses_degree`` (head groups inside, where
links are fastest on a real cluster).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import nn

from strategies.context.attention import ContextParallelAttention, apply_context_parallel
from strategies.context.attention_blocks import block_kernels
from strategies.context.layout import build_cp_layout, build_sub_layouts
from strategies.context.placement import HybridPlacement, group_sizes, placement_problems
from strategies.context.sharding import shard_batch
from strategies.core.model_contract import optional
from strategies.core.parallel_dims import Meshes, ParallelDims, divisors
from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

CPMode = Literal["ring", "ulysses", "hybrid"]
CP_MODES: tuple[str, ...] = get_args(CPMode)
Sharding = Literal["zigzag", "contiguous", "document"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)


# ---------------------------------------------------------------------------------- config
def ulysses_degree_for(mode: str, cp: int, ulysses_degree: int) -> int:
    """Ranks per head group: 1 for ring, cp for ulysses, ``ulysses_degree`` for hybrid."""
    return {"ring": 1, "ulysses": cp}.get(mode, ulysses_degree)


def context_parallel_problems(
    *, mode: str, cp: int, tp: int, ulysses_degree: int, n_heads: int, n_kv_heads: int
) -> list[str]:
    """Problems (each naming the fix) of a context-parallel layout for a model; [] if it fits."""
    if cp <= 1:
        return []
    if mode not in CP_MODES:
        return [f"strategy.context_parallel.mode={mode!r} is unknown; use one of {', '.join(CP_MODES)}"]
    problems = []
    u = ulysses_degree_for(mode, cp, ulysses_degree)
    if mode == "hybrid" and not (1 < u < cp and cp % u == 0):
        valid = [d for d in divisors(cp) if 1 < d < cp]
        problems.append(
            f"strategy.context_parallel.ulysses_degree={u} must divide cp={cp} and lie strictly between 1 and cp "
            f"for mode=hybrid; valid: {', '.join(map(str, valid)) or 'none (use strategy.context_parallel.mode=ring or ulysses)'}"
        )
    heads, kv_heads = n_heads // max(tp, 1), n_kv_heads // max(tp, 1)
    if u > 1 and (heads % u or kv_heads % u):
        valid = [d for d in divisors(cp) if heads % d == 0 and kv_heads % d == 0 and (mode != "hybrid" or 1 < d < cp)]
        name = "strategy.cp" if mode == "ulysses" else "strategy.context_parallel.ulysses_degree"
        problems.append(
            f"{name}={u}: Ulysses splits the {heads} query heads and {kv_heads} kv heads per tp rank "
            f"(n_heads={n_heads}, n_kv_heads={n_kv_heads}, tp={tp}) evenly; valid Ulysses degrees: "
            f"{', '.join(map(str, valid))} (or use strategy.context_parallel.mode=ring)"
        )
    return problems


@dataclass
class ContextParallel(HybridPlacement, StrategyPlugin):
    """The context-parallel plugin: settings of `apply_context_parallel` and `shard_batch`.

    The degree is ``strategy.cp``; the plugin is active when it is above 1. It places each step's
    rows (`place`: cp shards, or hybrid placement), marks the group a micro-batch attends over
    (`micro_batch_context`), keeps preference pairs whole (`shard`, `whole_rows`) and reports the
    hybrid placement's rows per group size (`after_step`).

    Args:
        mode: ``ring``, ``ulysses`` or ``hybrid`` (Ulysses head groups inside, a ring across them).
        ulysses_degree: ranks per head group in ``hybrid`` mode (ignored by ring and ulysses).
        load_balance: zigzag sharding (even causal work per rank) instead of contiguous shards.
        sharding: with ``load_balance``: ``zigzag`` (chunks of the row) or ``document`` (each
            document of a packed row zigzagged on its own, `strategies.context.document_shards`: even
            causal work per rank on packed rows); ``contiguous`` = ``load_balance=false``.
        kv_chunk: keys per score block in ring attention (0: whole blocks); lowers peak memory.
        kernel: ring attention's block kernels: ``auto`` (fused SDPA kernels on CUDA, eager fp32
            on CPU), ``fused`` or ``eager`` (`strategies.context.attention_blocks`).
        placement: ``split`` (every row over all cp ranks) or ``hybrid`` (each row on the smallest
            aligned group of 1, 2, 4, ... cp ranks that fits its longest document, whole on one
            rank at 1; preference pairs always whole: `strategies.context.placement`).
        activation_offload: an alias of ``strategy.activation_offload.enabled`` (the
            `strategies.activation_offload.ActivationOffload` plugin), kept for existing command lines:
            the preset's ``enabled`` follows it (conf/strategy/nd.yaml); this plugin reads it no more.
    """

    mode: CPMode = "ring"
    ulysses_degree: int = 2
    load_balance: bool = True
    sharding: Sharding = "zigzag"
    kv_chunk: int = 0
    kernel: str = "auto"
    placement: str = "split"
    activation_offload: bool = False
    core: ContextParallelAttention | None = field(default=None, init=False, repr=False)  # set by apply
    group_rows: dict[int, int] = field(
        default_factory=dict, init=False
    )  # rows of this cp group per group size, last step

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS or (self.sharding == "document" and not self.load_balance):
            raise ValueError(
                f"strategy.context_parallel.sharding={self.sharding!r} with load_balance={self.load_balance}: use one of "
                f"{', '.join(SHARDINGS)} (document lays documents out on the zigzag chunks: keep load_balance=true)"
            )
        if self.sharding == "contiguous":
            self.load_balance = False
        if self.ulysses_degree < 1 or self.kv_chunk < 0:
            raise ValueError(
                "strategy.context_parallel.ulysses_degree must be >= 1 and kv_chunk >= 0, got "
                f"{self.ulysses_degree} and {self.kv_chunk}"
            )
        block_kernels(torch.device("cpu"), self.kernel)  # fails on an unknown kernel name

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """The sequence length against the shards `shard_positions` cuts (2 cp with load balancing,
        else cp), and the mode against the model's heads (`context_parallel_problems`)."""
        cp = run.dims.cp
        problems = placement_problems(self.placement, cp=cp, pp=run.dims.pp, micro_batch_size=run.micro_batch_size)
        if cp <= 1:
            return problems
        parts = 2 * cp if self.load_balance else cp
        if run.seq_len % parts:
            why = f"2*cp={parts} (load-balanced ring attention)" if self.load_balance else f"cp={parts}"
            problems.append(
                f"data.seq_len={run.seq_len} is not divisible by {why}; use a seq_len that is a multiple of {parts}"
            )
        if shape is not None:
            problems += context_parallel_problems(
                mode=self.mode,
                cp=cp,
                tp=run.dims.tp,
                ulysses_degree=self.ulysses_degree,
                n_heads=shape.n_heads,
                n_kv_heads=shape.n_kv_heads,
            )
        return problems

    def apply(self, model: nn.Module, meshes: Meshes) -> None:
        """Context-parallel attention over the cp groups of ``meshes`` (in ``self.mode``)."""
        cp_ranks = meshes.cp_ranks()
        cp = len(cp_ranks[0])
        u = ulysses_degree_for(self.mode, cp, self.ulysses_degree)
        layout = build_cp_layout(cp_ranks, ulysses_degree=u)
        sub_layouts = {}
        if self.placement == "hybrid":  # the sub-groups hybrid placement may choose, created once here
            sub_layouts = build_sub_layouts(cp_ranks, group_sizes(cp), ulysses_degree=u)
        apply_context_parallel(
            model,
            layout=layout,
            load_balance=self.load_balance,
            kv_chunk=self.kv_chunk,
            kernel=self.kernel,
            sub_layouts=sub_layouts,
        )
        core = optional(model, "attention_core")
        self.core = core if isinstance(core, ContextParallelAttention) else None

    def shard_batch(self, batch: dict[str, torch.Tensor], *, cp: int, rank: int) -> dict[str, torch.Tensor]:
        return shard_batch(
            batch, cp=cp, rank=rank, load_balance=self.load_balance, documents=self.sharding == "document"
        )

    # ------------------------------------------------------------------ phases (`strategies.plugin`)
    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        return dims.cp > 1

    def shard(self, batch: dict[str, torch.Tensor], meshes: Meshes) -> dict[str, torch.Tensor]:
        """This cp rank's slice of the sequence dimension (`shard_batch`). ``[B, 2, T]`` preference
        pairs are never split: every cp rank evaluates them whole (`whole_rows`)."""
        if batch["input_ids"].dim() != 2:
            return batch
        return self.shard_batch(batch, cp=meshes["cp"].size(), rank=meshes["cp"].get_local_rank())

    def place(
        self, batch: dict[str, torch.Tensor], micro_batch_size: int, meshes: Meshes
    ) -> list[dict[str, torch.Tensor]]:
        """This cp rank's micro-batches (`micro_batches`: split, or hybrid placement)."""
        cp_mesh = meshes["cp"]
        return self.micro_batches(
            batch, cp=cp_mesh.size(), rank=cp_mesh.get_local_rank(), micro_batch_size=micro_batch_size
        )

    def micro_batch_context(
        self, micro_batch: dict[str, torch.Tensor]
    ) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """`training`: a micro-batch marked by hybrid placement attends over its group."""
        return self.training(micro_batch)

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """With hybrid placement: ``perf/cp_whole_rows`` (rows of this cp group trained whole in the
        step) and ``perf/cp_rows_g<g>`` (its rows on groups of g ranks; g = cp: split over the group)."""
        if self.placement != "hybrid":
            return {}
        rows = self.group_rows
        return {
            "perf/cp_whole_rows": float(rows.get(1, 0)),
            **{f"perf/cp_rows_g{g}": float(n) for g, n in sorted(rows.items())},
        }
