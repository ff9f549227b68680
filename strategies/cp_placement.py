"""Hybrid placement of packed rows under context parallelism: short rows whole on one cp rank.

Context parallelism (`strategies.context`) splits every row of a cp group over all its ranks, so
every row pays the ring's (or Ulysses') communication even when its documents are short and no
attention pair crosses a shard. ByteScale (Ge et al. 2025, "data-aware sharding") places short
sequences on single ranks and splits only the long ones over the group that fits them. Here, with
``strategy.context_parallel.placement=hybrid``, each step of a cp group:

- a row is *short* when its longest document holds at most ``T / cp`` tokens (what one rank holds
  of a split row); ``s`` = the short rows, rounded down to a multiple of ``cp`` and to the least
  ``s`` of all dp groups (`whole_row_count`), so that every rank runs the same number of forwards
  (FSDP gathers the parameters in each);
- ``s`` of them (the lightest) train whole, ``s / cp`` on each cp rank, like extra data parallelism:
  heaviest first, each to the rank with the least causal-attention work so far (`place_whole_rows`;
  every rank gets the same number of whole rows, hence the same linear work);
- the others are split over the whole cp group as before (`ContextParallel.shard_batch`).

Every token is trained exactly once in the step and the Task divides the summed token loss by the
step's global supervised-token count (summed over dp x cp), and gradients are summed over dp x cp
as before, so the step equals one process up to the order of floating-point sums. The layout is a
function of the rows alone (deterministic, ties by index), so resume is unchanged.

Whole rows hold ``T`` tokens on one rank where a split micro-batch holds ``micro_batch_size T/cp``:
a whole micro-batch takes ``micro_batch_size // cp`` rows, so ``micro_batch_size >= cp`` keeps the
activation memory of a forward at most what it was (`placement_problems`). Only groups of 1 and of
all cp ranks are used (no sub-groups of 2 of 4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from strategies.document_runs import causal_pairs, longest_document

PLACEMENTS = ("split", "hybrid")
WHOLE_ROWS = "cp_whole_rows"  # marks a micro-batch of whole rows (popped by the strategy before the forward)


def short_rows(document_ids_bt: torch.Tensor, cp: int) -> torch.Tensor:
    """``[B]`` bool: rows whose longest document fits one cp rank's shard (``T / cp`` tokens)."""
    return longest_document(document_ids_bt.cpu()) <= document_ids_bt.shape[1] // cp


def whole_row_count(document_ids_bt: torch.Tensor | None, cp: int, *, device: torch.device) -> int:
    """Rows of this cp group to train whole: its short rows rounded down to a multiple of ``cp``,
    the least over all ranks (an all-reduce over the default group, so every rank runs as many
    forwards). Rows without 2-D document ids (one document each, or preference records) count 0."""
    short = 0
    if document_ids_bt is not None and document_ids_bt.dim() == 2:
        short = int(short_rows(document_ids_bt, cp).sum()) // cp * cp
    count = torch.tensor([short], device=device)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def place_whole_rows(work: torch.Tensor, cp: int) -> list[list[int]]:
    """Row indices each cp rank trains whole: ``len(work) / cp`` rows each, heaviest first to the
    rank with the least work so far among those not full (ties to the lower rank; longest
    processing time first with equal cardinality).

    Args:
        work: ``[s]`` estimated work of the whole rows, ``s`` a multiple of ``cp``.
        cp: cp ranks.
    """
    per_rank = work.shape[0] // cp
    placed: list[list[int]] = [[] for _ in range(cp)]
    load = [0.0] * cp
    for i in sorted(range(work.shape[0]), key=lambda i: (-float(work[i]), i)):
        r = min((r for r in range(cp) if len(placed[r]) < per_rank), key=lambda r: (load[r], r))
        placed[r].append(i)
        load[r] += float(work[i])
    return [sorted(rows) for rows in placed]


@dataclass(frozen=True)
class Placement:
    """One cp group's layout of a step: ``whole[c]`` the rows cp rank c trains whole, ``split`` the
    rows split over the group (indices into the group's rows, ascending)."""

    whole: tuple[torch.Tensor, ...]
    split: torch.Tensor


def plan_placement(document_ids_bt: torch.Tensor, cp: int, count: int) -> Placement:
    """The layout of a cp group's ``[B, T]`` rows with ``count`` whole rows (`whole_row_count`):
    the ``count`` short rows of least causal work train whole (`place_whole_rows`), the rest split."""
    docs = document_ids_bt.cpu()
    B = docs.shape[0]
    pairs = causal_pairs(docs)
    if count == 0:
        return Placement(tuple(torch.zeros(0, dtype=torch.int64) for _ in range(cp)), torch.arange(B))
    short = torch.nonzero(short_rows(docs, cp)).flatten().tolist()
    chosen = sorted(sorted(short, key=lambda i: (int(pairs[i]), i))[:count])
    whole = place_whole_rows(pairs[chosen].double(), cp)
    taken = set(chosen)
    split = torch.tensor([i for i in range(B) if i not in taken], dtype=torch.int64)
    return Placement(tuple(torch.tensor([chosen[j] for j in rows], dtype=torch.int64) for rows in whole), split)


def rows_of(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows ``index`` of every tensor of ``batch`` (0-dim entries pass unchanged)."""
    return {k: v[index.to(v.device)] if v.dim() else v for k, v in batch.items()}


def micro_batches_of(batch: dict[str, torch.Tensor], rows: int, *, whole: bool = False) -> list[dict[str, Any]]:
    """``batch`` cut into micro-batches of ``rows`` rows; ``whole`` marks them (`WHOLE_ROWS`)."""
    n = batch["input_ids"].shape[0]
    marker = {WHOLE_ROWS: torch.ones(())} if whole else {}
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
        problems.append(f"{key} does not run under pipeline parallelism (strategy.pp={pp}); use strategy.pp=1 or placement=split")
    if micro_batch_size < cp:
        problems.append(
            f"{key} trains whole rows ({cp}x a shard's tokens) in micro-batches of micro_batch_size // cp rows: "
            f"train.micro_batch_size={micro_batch_size} < cp={cp} would raise a forward's activation memory; "
            f"set train.micro_batch_size >= {cp} or placement=split"
        )
    return problems


def hybrid_micro_batches(
    batch: dict[str, torch.Tensor],
    *,
    cp: int,
    rank: int,
    micro_batch_size: int,
    shard: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> tuple[list[dict[str, Any]], int]:
    """This cp rank's micro-batches of its cp group's rows under hybrid placement, and the
    group's number of whole rows: first its whole rows (marked `WHOLE_ROWS`, ``micro_batch_size
    // cp`` rows each), then its shards of the split rows (``shard``, ``micro_batch_size`` rows each).
    Every rank gets as many micro-batches of each kind (`whole_row_count`)."""
    count = whole_row_count(batch.get("document_ids"), cp, device=batch["input_ids"].device)
    if count == 0:
        return micro_batches_of(shard(batch), micro_batch_size), 0
    placed = plan_placement(batch["document_ids"], cp, count)
    whole = micro_batches_of(rows_of(batch, placed.whole[rank]), max(1, micro_batch_size // cp), whole=True)
    if placed.split.numel() == 0:
        return whole, count
    return whole + micro_batches_of(shard(rows_of(batch, placed.split)), micro_batch_size), count


@dataclass(frozen=True)
class WholeRows:
    """The mask of a forward over whole rows (no cp split): what the one-process core made
    (`strategies.context.ContextParallelAttention` attends with that core when it sees one)."""

    mask: Any


class HybridPlacement:
    """The context-parallel plugin's step methods (`strategies.context.ContextParallel` mixes it
    in: ``placement``, ``core`` (its attention core, set by ``apply``), ``shard_batch`` and
    ``whole_row_count`` are the plugin's)."""

    placement: str
    core: Any
    whole_row_count: int
    shard_batch: Callable[..., dict[str, torch.Tensor]]

    def micro_batches(
        self, batch: dict[str, torch.Tensor], *, cp: int, rank: int, micro_batch_size: int
    ) -> list[dict[str, torch.Tensor]]:
        """This cp rank's micro-batches of its group's rows: every row sharded (``split``), or with
        ``hybrid`` placement whole short rows first (`hybrid_micro_batches`;
        the group's whole rows are kept in ``whole_row_count`` for the step's metrics)."""
        def shard(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return self.shard_batch(rows, cp=cp, rank=rank)

        if self.placement != "hybrid" or self.core is None:
            return micro_batches_of(shard(batch), micro_batch_size)
        micro_batches, self.whole_row_count = hybrid_micro_batches(
            batch, cp=cp, rank=rank, micro_batch_size=micro_batch_size, shard=shard
        )
        return micro_batches

    @contextmanager
    def training(self, micro_batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """The micro-batch without its `WHOLE_ROWS` mark; while active, a marked one attends whole."""
        whole = WHOLE_ROWS in micro_batch
        rows = {k: v for k, v in micro_batch.items() if k != WHOLE_ROWS}
        if self.core is None:
            yield rows
            return
        with self.core.training_whole_rows(whole):
            yield rows
