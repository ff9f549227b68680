"""Context parallelism on the ``cp`` mesh axis: ring, Ulysses and hybrid (head x context) attention.

Sources: Liu et al. 2023, "Ring Attention" (k/v blocks around a ring, see `ring_attention`);
Jacobs et al. 2023, "DeepSpeed Ulysses" (all-to-all from sequence sharding to head sharding around
attention, and back); Gu et al. 2024, "LoongTrain" (2-D head x context parallelism: Ulysses inside
a group of ranks, ring attention across groups); the zigzag load balancing of causal attention
(each rank holds one chunk from the head and the mirrored chunk from the tail of the sequence;
Brandon et al. 2023, "Striped Attention", discuss the imbalance).

Every cp rank keeps ``T/cp`` tokens of each row (`shard_batch`, before the step counts supervised
tokens: the Task sums the counts over dp x cp, so a shard without supervised tokens adds exactly 0,
case C03). Between attentions nothing needs the other shards: embeddings, norms, MLP and the loss
are per token. Attention is replaced per module by `ContextParallelAttention`, which knows the
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

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from strategies.context.attention_blocks import block_kernels
from strategies.context.document_shards import shard_documents
from strategies.context.layout import CPLayout, build_cp_layout, build_sub_layouts
from strategies.context.placement import HybridPlacement, OnGroup, WholeRows, group_sizes, placement_problems
from strategies.context.ring import RingMasks, ring_attention
from strategies.context.ulysses import heads_to_seq, seq_to_heads
from strategies.core.model_contract import declares, optional
from strategies.core.parallel_dims import Meshes, ParallelDims, divisors
from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

CPMode = Literal["ring", "ulysses", "hybrid"]
CP_MODES: tuple[str, ...] = get_args(CPMode)
Sharding = Literal["zigzag", "contiguous", "document"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)


# ---------------------------------------------------------------------------------- sharding
def shard_positions(seq_len: int, cp: int, rank: int, *, load_balance: bool = True) -> torch.Tensor:
    """Positions (``[seq_len / cp]`` int64) of the tokens that cp rank ``rank`` keeps, in memory order.

    With ``load_balance`` the sequence is cut into ``2 * cp`` chunks and rank r keeps chunks r and
    ``2cp - 1 - r``: every rank then has the same causal work. Without it, rank r keeps the r-th
    contiguous ``seq_len / cp`` tokens.

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * cp`` (``cp`` without ``load_balance``).
    """
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} (context parallelism, cp={cp})")
    c = seq_len // parts
    if not load_balance:
        return torch.arange(rank * c, (rank + 1) * c)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def shard_batch(
    batch: dict[str, torch.Tensor], *, cp: int, rank: int, load_balance: bool = True, documents: bool = False
) -> dict[str, torch.Tensor]:
    """This cp rank's tokens of every ``[B, T]`` tensor in ``batch`` (input ids, labels, positions, documents).

    Labels are pre-shifted by the data pipeline, so sharding them with the inputs keeps each
    target with its position. Missing ``position_ids`` are filled with ``arange(T)`` first (the
    model would otherwise number the shard's tokens from 0). Other entries pass unchanged.
    With ``documents`` (and ``load_balance``) each document of a packed row is zigzagged on its
    own (`strategies.context.document_shards`; rows without ``document_ids`` shard as plain zigzag).
    """
    seq_len = batch["input_ids"].shape[1]
    if "position_ids" not in batch:
        batch = {
            **batch,
            "position_ids": torch.arange(seq_len, device=batch["input_ids"].device).expand_as(batch["input_ids"]),
        }
    index = shard_positions(seq_len, cp, rank, load_balance=load_balance).to(batch["input_ids"].device)
    if documents and load_balance and "document_ids" in batch:
        return shard_documents(batch, index, cp)
    return {k: v[:, index] if v.dim() >= 2 and v.shape[1] == seq_len else v for k, v in batch.items()}


def causal_work(document_ids_t: torch.Tensor, cp: int, *, load_balance: bool) -> list[int]:
    """Query-key pairs each cp rank's queries attend (block-diagonal causal) in one row ``[T]``.

    The attention FLOPs of a rank are proportional to its count; ``max / mean`` is the imbalance.
    """
    seq_len = document_ids_t.shape[0]
    pos = torch.arange(seq_len)
    work = []
    for rank in range(cp):
        q = shard_positions(seq_len, cp, rank, load_balance=load_balance)
        allowed = (pos[None, :] <= q[:, None]) & (document_ids_t[None, :] == document_ids_t[q][:, None])
        work.append(int(allowed.sum()))
    return work


# ---------------------------------------------------------------------------------- the attention core
class ContextParallelAttention:
    """The attention core of every `Attention` module under context parallelism.

    ``mask`` runs once per model forward and gathers the document ids of the whole row over the
    cp group; ``__call__`` runs in each layer: Ulysses all-to-all (if any), ring attention over
    the head groups, all-to-all back.

    Args:
        layout: this rank's groups (`build_cp_layout`).
        load_balance: the sharding `shard_batch` used (zigzag or contiguous).
        kv_chunk: keys per score block in `ring_attention` (0: whole blocks).
        kernel: the block kernels (`strategies.context.attention_blocks.block_kernels`): ``auto`` (fused
            on CUDA, eager fp32 on CPU), ``fused`` or ``eager``.
        whole: the model's one-process core (whole rows); sub_layouts: this rank's cp sub-groups
            by size (`strategies.context.layout.build_sub_layouts`), both for hybrid placement.
    """

    def __init__(
        self,
        layout: CPLayout,
        *,
        load_balance: bool = True,
        kv_chunk: int = 0,
        kernel: str = "auto",
        whole: Any = None,
        sub_layouts: dict[int, CPLayout] | None = None,
    ) -> None:
        block_kernels(torch.device("cpu"), kernel)  # fails on an unknown kernel name
        self.layout, self.load_balance, self.kv_chunk, self.kernel = layout, load_balance, kv_chunk, kernel
        self.whole, self.sub_layouts = whole, dict(sub_layouts or {})  # the one-process core; cp sub-groups
        self.group_size = layout.cp  # ranks the rows of the current forward are split over

    @contextmanager
    def training_group(self, size: int) -> Iterator[None]:
        """While active, forwards attend over the rows of a cp group of ``size`` ranks
        (`strategies.context.placement`): 1 with the one-process core (whole rows), a sub-group size
        with its layout (``sub_layouts``), the cp degree as usual. The masks made then carry the
        choice, so a recompute under activation checkpointing attends the same way.

        Raises:
            ValueError: no layout of that size (no one-process core for 1, or no such sub-group).
        """
        if size != self.layout.cp and not (size == 1 and self.whole is not None) and size not in self.sub_layouts:
            raise ValueError(
                f"no cp group of {size} ranks (built: 1, {', '.join(map(str, sorted(self.sub_layouts)))}, {self.layout.cp})"
            )
        self.group_size = size
        try:
            yield
        finally:
            self.group_size = self.layout.cp

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> RingMasks:
        """Positions and document ids of the queries and keys each layer's ring step sees.

        Args:
            document_ids_bt: this rank's ``[B, T/cp]`` document ids, or None (plain causal rows).
            seq_len: this rank's token count ``T/cp``.
            device: the device of the activations.
        """
        if self.group_size == 1:
            return WholeRows(self.whole.mask(document_ids_bt, seq_len, device))
        if self.group_size != self.layout.cp:
            lay = self.sub_layouts[self.group_size]
            return OnGroup(lay, self._ring_masks(lay, document_ids_bt, seq_len, device))
        return self._ring_masks(self.layout, document_ids_bt, seq_len, device)

    def _ring_masks(
        self, lay: CPLayout, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> RingMasks:
        pos = [shard_positions(seq_len * lay.cp, lay.cp, c, load_balance=self.load_balance) for c in range(lay.cp)]
        docs = None
        if document_ids_bt is not None:
            docs = [torch.empty_like(document_ids_bt) for _ in range(lay.cp)]
            dist.all_gather(docs, document_ids_bt.contiguous(), group=lay.cp_group)
        u = lay.ulysses_degree
        # A head group holds the tokens of its u ranks, concatenated in rank order (seq_to_heads).
        group_pos = tuple(torch.cat(pos[i : i + u]) for i in range(0, lay.cp, u))
        group_docs = None if docs is None else tuple(torch.cat(docs[i : i + u], dim=1) for i in range(0, lay.cp, u))
        me = lay.index // u
        on_host = torch.device(device).type == "cpu"
        return RingMasks(
            group_pos[me].to(device),
            None if group_docs is None else group_docs[me],
            tuple(p.to(device) for p in group_pos),
            group_docs,
            pos_kv_host=None if on_host else group_pos,
            last_query=int(group_pos[me].max()),
        )

    def __call__(
        self, q_bthe: torch.Tensor, k_btke: torch.Tensor, v_btke: torch.Tensor, masks: RingMasks
    ) -> torch.Tensor:
        """``[B, T/cp, H, E]`` queries and ``[B, T/cp, K, E]`` keys/values (after RoPE) -> ``[B, T/cp, H, E]``."""
        if isinstance(masks, WholeRows):
            return self.whole(q_bthe, k_btke, v_btke, masks.mask)
        lay = self.layout
        if isinstance(masks, OnGroup):
            lay, masks = masks.layout, masks.masks
        u = lay.ulysses_degree
        if u > 1:
            H, K = q_bthe.shape[2], k_btke.shape[2]
            if H % u or K % u:
                raise ValueError(f"Ulysses degree {u} must divide the local query heads {H} and kv heads {K}")
            q_bthe, k_btke, v_btke = (seq_to_heads(t, lay.ulysses_group, u) for t in (q_bthe, k_btke, v_btke))
        B, T, H, E = q_bthe.shape
        K = k_btke.shape[2]
        q_bkrqe = q_bthe.view(B, T, K, H // K, E).permute(0, 2, 3, 1, 4)
        out = ring_attention(
            q_bkrqe,
            k_btke.transpose(1, 2),
            v_btke.transpose(1, 2),
            ring=lay.ring,
            masks=masks,
            kv_chunk=self.kv_chunk,
            blocks=block_kernels(q_bthe.device, self.kernel),
        )
        out_bthe = out.permute(0, 3, 1, 2, 4).reshape(B, T, H, E)
        return heads_to_seq(out_bthe, lay.ulysses_group, u) if u > 1 else out_bthe


def apply_context_parallel(
    model: nn.Module,
    *,
    layout: CPLayout,
    load_balance: bool = True,
    kv_chunk: int = 0,
    kernel: str = "auto",
    sub_layouts: dict[int, CPLayout] | None = None,
) -> None:
    """Makes every attention module of ``model`` context-parallel, in place.

    ``model`` must offer ``set_attention_core`` (`trainer.models.llama.Llama`); a model without
    attention (a per-token test model) is left unchanged: per-token layers need no change under CP.
    """
    if declares(model, "set_attention_core"):
        core = ContextParallelAttention(
            layout,
            load_balance=load_balance,
            kv_chunk=kv_chunk,
            kernel=kernel,
            whole=model.attention_core,
            sub_layouts=sub_layouts,
        )
        model.set_attention_core(core)


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
