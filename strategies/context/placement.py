"""Hybrid placement of packed rows under context parallelism: each row on the smallest cp group that fits it.

Context parallelism (`strategies.context.plugin`) splits every row of a cp group over all its ranks, so
every row pays the ring's (or Ulysses') communication even when its documents are short. ByteScale
(Ge et al. 2025, "data-aware sharding") splits each sequence over just enough ranks and keeps short
ones whole. Here, with ``strategy.context_parallel.placement=hybrid``, the groups are aligned
blocks of ``g`` ranks of the cp dim, ``g`` in 1, 2, 4, ... below cp (`group_sizes`; the sub-groups
are created once at setup, `strategies.context.layout.build_sub_layouts`), and each step of a cp group:

- **memory**: a forward holds at most what a split micro-batch holds, ``micro_batch_size T / cp``
  tokens per rank (activation memory is linear in tokens under blockwise attention): a group of
  ``g`` ranks trains ``micro_batch_size g / cp`` rows per micro-batch (`rows_per_micro_batch`), so
  only the sizes where that is >= 1 are used;
- **fit**: a row fits ``g`` ranks when its longest document holds at most ``g T / cp`` tokens (what
  ``g`` ranks hold of a split row; at g = 1: one shard), and goes to the smallest usable size that
  fits (`fit_sizes`); the others are split over the whole cp group as before. Preference pairs
  ``[B, 2, T]`` fit 1 (both halves of a pair whole on one rank: their objectives sum log-probs
  over whole rows and are never split);
- **counts** (`group_row_counts`): per size, the rows that fit it or a smaller one, the least
  over all ranks (one all-reduce of ``len(sizes)`` ints per step on the default group), then the
  smallest sizes first take as many as they can in multiples of ``cp / g`` (each sub-group gets
  the same number), the rest carry on to the next size (`row_counts`). Every rank hence runs as
  many forwards of each kind (FSDP gathers the parameters in each);
- **rows** (`plan_placement`): each size takes the lightest (causal pairs) of the rows left that
  fit it, spread over its ``cp / g`` sub-groups heaviest first to the least loaded (`place_rows`).
  A sub-group shards its rows as the cp group would (zigzag or document sharding over ``g``) and
  attends over its own ring / all-to-all groups.

Every token is trained exactly once in the step, the Task divides the summed token loss by the
step's global supervised-token count and gradients are summed over dp x cp as before, so the step
equals one process up to the order of floating-point sums. The layout is a function of the step's
rows alone (deterministic, ties by index), so resume is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from strategies.core.document_runs import causal_pairs, longest_document

PLACEMENTS = ("split", "hybrid")
CP_GROUP = (
    "cp_group_size"  # 0-dim: the cp group size of a micro-batch's rows (popped by the strategy before the forward)
)
Shard = Callable[[dict[str, torch.Tensor], int, int], dict[str, torch.Tensor]]  # (rows, group size, index) -> shard


def group_sizes(cp: int, micro_batch_size: int | None = None) -> tuple[int, ...]:
    """The cp group sizes below ``cp`` that hybrid placement may use: 1, 2, 4, ... dividing ``cp``;
    given ``micro_batch_size``, only those whose micro-batches hold a row (`rows_per_micro_batch`)."""
    sizes, g = [], 1
    while g < cp and cp % g == 0:
        sizes.append(g)
        g *= 2
    return tuple(g for g in sizes if micro_batch_size is None or micro_batch_size * g >= cp)


def rows_per_micro_batch(micro_batch_size: int, cp: int, size: int) -> int:
    """Rows of a micro-batch on a group of ``size`` ranks: as many tokens per rank as a split one."""
    return micro_batch_size * size // cp


def fit_sizes(document_ids: torch.Tensor, cp: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """``[B]`` int64: the smallest of ``sizes`` whose ranks hold each row's longest document
    (``<= g T / cp`` tokens), else ``cp``; for ``[B, 2, T]`` preference pairs 1 (never split)."""
    if document_ids.dim() == 3:
        return torch.ones(document_ids.shape[0], dtype=torch.int64)
    longest, seq_len = longest_document(document_ids.cpu()), document_ids.shape[-1]
    fit = torch.full_like(longest, cp)
    for g in reversed(sizes):
        fit[longest * cp <= g * seq_len] = g
    return fit


def row_counts(prefix: list[int], cp: int, sizes: tuple[int, ...]) -> dict[int, int]:
    """Rows per size from ``prefix[i]``, the rows that fit ``sizes[i]`` or a smaller size: the
    smallest first, each as many as it can in multiples of ``cp / g``; the rest carry on."""
    counts, used = {}, 0
    for g, fitting in zip(sizes, prefix):
        k = cp // g
        counts[g] = (fitting - used) // k * k
        used += counts[g]
    return counts


def group_row_counts(
    document_ids: torch.Tensor | None, cp: int, sizes: tuple[int, ...], *, device: torch.device
) -> dict[int, int]:
    """`row_counts` of the least prefix counts over all ranks (an all-reduce over the default
    group: every rank then runs as many forwards of each size). Rows without document ids (one
    document each) fit no size below ``cp``."""
    prefix = torch.zeros(len(sizes), dtype=torch.int64)
    if document_ids is not None and sizes:
        fit = fit_sizes(document_ids, cp, sizes)
        prefix = torch.stack([(fit <= g).sum() for g in sizes])
    prefix = prefix.to(device)
    if dist.is_initialized() and sizes:
        dist.all_reduce(prefix, op=dist.ReduceOp.MIN)
    return row_counts(prefix.tolist(), cp, sizes)


def place_rows(work: torch.Tensor, groups: int) -> list[list[int]]:
    """Row indices of each of ``groups`` groups: ``len(work) / groups`` rows each, heaviest first to
    the group with the least work so far among those not full (ties to the lower group; longest
    processing time first with equal cardinality).

    Args:
        work: ``[s]`` estimated work of the rows, ``s`` a multiple of ``groups``.
        groups: the groups (cp ranks for whole rows, ``cp / g`` sub-groups of ``g`` ranks).
    """
    per_group = work.shape[0] // groups
    placed: list[list[int]] = [[] for _ in range(groups)]
    load = [0.0] * groups
    for i in sorted(range(work.shape[0]), key=lambda i: (-float(work[i]), i)):
        r = min((r for r in range(groups) if len(placed[r]) < per_group), key=lambda r: (load[r], r))
        placed[r].append(i)
        load[r] += float(work[i])
    return [sorted(rows) for rows in placed]


@dataclass(frozen=True)
class Placement:
    """One cp group's layout of a step: ``groups[g][b]`` the rows that sub-group ``b`` of ``g``
    ranks trains (cp ranks ``b g .. (b + 1) g - 1``; ``g = 1``: whole rows), ``split`` the rows split
    over the whole group (indices into the group's rows, ascending)."""

    groups: dict[int, tuple[torch.Tensor, ...]]
    split: torch.Tensor


def plan_placement(document_ids: torch.Tensor, cp: int, counts: dict[int, int]) -> Placement:
    """The layout of a cp group's ``[B, T]`` rows (or ``[B, 2, T]`` pairs) with ``counts[g]`` rows on
    groups of ``g`` ranks (`group_row_counts`): smallest size first, the lightest rows left that fit."""
    docs = document_ids.cpu()
    work = causal_pairs(docs)
    work = work.sum(-1) if work.dim() == 2 else work  # a pair: both rows
    fit = fit_sizes(docs, cp, tuple(counts))
    left, groups = list(range(docs.shape[0])), {}
    for g, n in counts.items():
        if n == 0:
            continue
        chosen = sorted(sorted((i for i in left if fit[i] <= g), key=lambda i: (int(work[i]), i))[:n])
        left = [i for i in left if i not in set(chosen)]
        bins = place_rows(work[chosen].double(), cp // g)
        groups[g] = tuple(torch.tensor([chosen[j] for j in rows], dtype=torch.int64) for rows in bins)
    return Placement(groups, torch.tensor(left, dtype=torch.int64))


def rows_of(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows ``index`` of every tensor of ``batch`` (0-dim entries pass unchanged)."""
    return {k: v[index.to(v.device)] if v.dim() else v for k, v in batch.items()}


def micro_batches_of(batch: dict[str, torch.Tensor], rows: int, *, group: int | None = None) -> list[dict[str, Any]]:
    """``batch`` cut into micro-batches of ``rows`` rows; ``group`` marks their cp group size (`CP_GROUP`)."""
    n = batch["input_ids"].shape[0]
    marker = {} if group is None else {CP_GROUP: torch.tensor(group)}
    return [{**{k: v[i : i + rows] for k, v in batch.items()}, **marker} for i in range(0, n, rows)]


def placement_problems(placement: str, *, cp: int, pp: int, micro_batch_size: int) -> list[str]:
    """Problems (each naming the fix) of ``strategy.context_parallel.placement`` in a layout."""
    if placement not in PLACEMENTS:
        return [f"strategy.context_parallel.placement={placement!r} is unknown; use one of {', '.join(PLACEMENTS)}"]
    if placement == "split":
        return []
    key = "strategy.context_parallel.placement=hybrid"
    if cp <= 1:
        return [f"{key} places rows over cp ranks but strategy.cp={cp}; set strategy.cp > 1 or placement=split"]
    problems = []
    if pp > 1:
        problems.append(
            f"{key} does not run under pipeline parallelism (strategy.pp={pp}); use strategy.pp=1 or placement=split"
        )
    if not group_sizes(cp, micro_batch_size):
        least = cp // max(group_sizes(cp))
        problems.append(
            f"{key} trains rows on groups of g < cp ranks in micro-batches of micro_batch_size * g / cp rows "
            f"(no more tokens per forward than a split one): train.micro_batch_size={micro_batch_size} leaves no group "
            f"at cp={cp}; set train.micro_batch_size >= {least} or placement=split"
        )
    return problems


def hybrid_micro_batches(
    batch: dict[str, torch.Tensor], *, cp: int, rank: int, micro_batch_size: int, shard: Shard
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """This cp rank's micro-batches of its cp group's rows under hybrid placement, and the group's
    rows per group size (``cp``: split): per size, smallest first, its sub-group's rows (sharded
    over the sub-group by ``shard(rows, g, rank % g)``, whole at g = 1), marked `CP_GROUP`, then its
    shards of the split rows (``shard(rows, cp, rank)``). Every rank gets as many micro-batches of
    each size (`group_row_counts`).

    Raises:
        ValueError: preference pairs left to split (they train whole only; validate refuses such layouts).
    """
    sizes = group_sizes(cp, micro_batch_size)
    if batch["input_ids"].dim() == 3:
        sizes = tuple(g for g in sizes if g == 1)  # pairs: whole or not at all
    counts = group_row_counts(batch.get("document_ids"), cp, sizes, device=batch["input_ids"].device)
    rows = batch["input_ids"].shape[0]
    if not any(counts.values()):
        placed = Placement({}, torch.arange(rows))
    else:
        placed = plan_placement(batch["document_ids"], cp, counts)
    if placed.split.numel() and batch["input_ids"].dim() == 3:
        raise ValueError(
            f"{placed.split.numel()} of {rows} preference pairs would be split over cp={cp} ranks; pairs train whole "
            f"only: use rows per dp rank that are a multiple of cp and train.micro_batch_size >= cp"
        )
    micro_batches = []
    for g, groups in placed.groups.items():
        mine = rows_of(batch, groups[rank // g])
        micro_batches += micro_batches_of(
            mine if g == 1 else shard(mine, g, rank % g), rows_per_micro_batch(micro_batch_size, cp, g), group=g
        )
    if placed.split.numel():
        micro_batches += micro_batches_of(shard(rows_of(batch, placed.split), cp, rank), micro_batch_size)
    return micro_batches, {**{g: counts.get(g, 0) for g in sizes}, cp: placed.split.numel()}


@dataclass(frozen=True)
class WholeRows:
    """The mask of a forward over whole rows (no cp split): what the one-process core made
    (`strategies.context.attention.ContextParallelAttention` attends with that core when it sees one)."""

    mask: Any


@dataclass(frozen=True)
class OnGroup:
    """The masks of a forward over rows split on a cp sub-group, with the sub-group's layout
    (`strategies.context.layout.CPLayout`): the attention core runs over that layout's groups."""

    layout: Any
    masks: Any


class HybridPlacement:
    """The context-parallel plugin's step methods (`strategies.context.plugin.ContextParallel` mixes it
    in: ``placement``, ``core`` (its attention core, set by ``apply``), ``shard_batch`` and
    ``group_rows`` are the plugin's)."""

    placement: str
    core: Any
    group_rows: dict[int, int]
    shard_batch: Callable[..., dict[str, torch.Tensor]]

    def micro_batches(
        self, batch: dict[str, torch.Tensor], *, cp: int, rank: int, micro_batch_size: int
    ) -> list[dict[str, torch.Tensor]]:
        """This cp rank's micro-batches of its group's rows: every row sharded (``split``), or with
        ``hybrid`` placement on the smallest group that fits (`hybrid_micro_batches`; the group's
        rows per group size are kept in ``group_rows`` for the step's metrics)."""

        def shard(rows: dict[str, torch.Tensor], size: int, index: int) -> dict[str, torch.Tensor]:
            return self.shard_batch(rows, cp=size, rank=index)

        if self.placement != "hybrid" or self.core is None:
            return micro_batches_of(shard(batch, cp, rank), micro_batch_size)
        micro_batches, self.group_rows = hybrid_micro_batches(
            batch, cp=cp, rank=rank, micro_batch_size=micro_batch_size, shard=shard
        )
        return micro_batches

    def whole_rows(self) -> AbstractContextManager[None]:
        """Forwards inside attend with the one-process core (rows whole on this rank)."""
        return nullcontext() if self.core is None else self.core.training_group(1)

    @contextmanager
    def training(self, micro_batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """The micro-batch without its `CP_GROUP` mark; while active, a marked one attends over its group."""
        rows = {k: v for k, v in micro_batch.items() if k != CP_GROUP}
        if self.core is None or CP_GROUP not in micro_batch:
            yield rows
            return
        with self.core.training_group(int(micro_batch[CP_GROUP])):
            yield rows
