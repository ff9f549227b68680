"""Work balance of a step: which dp rank and micro-batch trains which row of the global batch.

Packed rows all hold ``seq_len`` tokens, but attention under a document mask costs each document
its causal query-key pairs, ``L (L + 1) / 2`` for ``L`` tokens: a row of one 4096-token document
costs far more than a row of 64-token ones. A static layout (dp rank r takes the r-th contiguous
slice of the global batch, micro-batches its consecutive rows) leaves the slowest rank to set the
step time. This module estimates each row's work and orders the global batch so that every dp
rank's slice, and each of its micro-batches, carries about the same work (ByteScale, Ge et al.
2025, "balance scheduler"; Zeppelin, 2025, cost-aware partitioning: here over whole rows).

The set of rows of a step is unchanged (only their order), and the Task divides the summed
token loss by the step's global supervised-token count, so the step's loss and gradient are the
same as without balancing up to the order of floating-point sums. The order is a deterministic
function of the global batch's content, so a resumed run plans the same order (exact resume).

The work model (forward FLOPs of a Llama-style model; backward is about twice both terms):

- linear: ``2 * (n_layers * matmul_params_per_layer + vocab_size * dim)`` per token,
- attention: ``4 * dim * n_layers`` per causal pair (scores ``Q K^T`` and ``P V``).

Dense-mask attention kernels (SDPA with a block-diagonal mask, the CPU path) compute every pair
of the row whatever its documents, so there the estimate is not the time; document-aware kernels
(FlexAttention block masks, flash varlen) skip the masked pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from strategies.core.document_runs import causal_pairs as document_causal_pairs
from strategies.core.shape import ModelShape

BALANCE = ("none", "work")


@dataclass(frozen=True)
class WorkModel:
    """Estimated work of a row: ``linear_per_token * tokens + attention_per_pair * causal pairs``
    (FLOPs of one forward when made by `of`)."""

    linear_per_token: float = 0.0
    attention_per_pair: float = 1.0

    @classmethod
    def of(cls, shape: ModelShape | None) -> WorkModel:
        """The forward FLOPs of ``shape`` (module docstring); causal pairs alone without a shape."""
        if shape is None:
            return cls()
        linear = 2.0 * (shape.n_layers * shape.matmul_params_per_layer() + shape.vocab_size * shape.dim)
        return cls(linear_per_token=linear, attention_per_pair=4.0 * shape.dim * shape.n_layers)

    def rows(self, document_ids: Tensor) -> Tensor:
        """``[N]`` float64 work of ``N`` rows from their ``[N, ..., S]`` document ids (a record of
        several sequences, like a preference pair, sums them). A document is a run of equal ids."""
        n, seq_len = document_ids.shape[0], document_ids.shape[-1]
        flat = document_ids.reshape(-1, seq_len)
        return (self.linear_per_token * seq_len + self.attention_per_pair * causal_pairs(flat)).reshape(n, -1).sum(1)


def causal_pairs(document_ids: Tensor) -> Tensor:
    """``[R]`` float64: causal query-key pairs of ``R`` rows under a document mask, from their
    ``[R, S]`` document ids: each token attends the tokens of its run of equal ids up to itself."""
    if document_ids.numel() == 0:
        return torch.zeros(document_ids.shape[0], dtype=torch.float64)
    return document_causal_pairs(document_ids).to(torch.float64)


def cells(work: Tensor, *, dp_size: int, micro_batch_size: int) -> Tensor:
    """``[dp, M]`` work of each dp rank's micro-batches for rows in their order (rank r: the r-th
    contiguous slice; micro-batches: consecutive runs of ``micro_batch_size`` rows, the last may be
    shorter)."""
    local = work.reshape(dp_size, -1)
    return torch.stack([part.sum(dim=1) for part in local.split(micro_batch_size, dim=1)], dim=1)


def step_cost(cell_work: Tensor) -> float:
    """Estimated step time of ``[dp, M]`` cell work: ranks wait for each other at every micro-batch
    (FSDP gathers per layer), so the sum over micro-batches of the slowest rank's. It bounds the
    maximum work per rank (``max_r sum_k``, the time with one synchronisation per step) from above
    and equals it for one micro-batch."""
    return float(cell_work.amax(dim=0).sum())


def plan(work: Tensor, *, dp_size: int, micro_batch_size: int) -> Tensor:
    """The order of a global batch's rows that balances the work per dp rank and micro-batch.

    After ``rows[order]``, dp rank r trains the r-th contiguous slice (``N / dp`` rows) and its
    micro-batches are consecutive runs of ``micro_batch_size`` rows, as without balancing. Greedy,
    heaviest rows first: micro-batch slot k (its ``dp x rows`` cells) takes the next run of rows by
    work, so the rows trained side by side are alike; within a slot each row goes to the rank whose
    cell holds the least work, ties to the rank with the least work so far (longest processing
    time first, so ranks are balanced per micro-batch, where FSDP synchronises, and per step).
    Deterministic (ties by index); the identity when it does not lower `step_cost`.

    Args:
        work: ``[N]`` work of each row (`WorkModel.rows`); N a multiple of ``dp_size``.
        dp_size: dp ranks.
        micro_batch_size: rows per forward on one rank.

    Returns:
        ``[N]`` int64 permutation.
    """
    n = work.shape[0]
    local = n // dp_size
    sizes = [min(micro_batch_size, local - start) for start in range(0, local, micro_batch_size)]
    heavy_first = sorted(range(n), key=lambda i: (-float(work[i]), i))
    placed: list[list[list[int]]] = [[[] for _ in sizes] for _ in range(dp_size)]
    rank_work, start = [0.0] * dp_size, 0
    for k, size in enumerate(sizes):
        cell_work = [0.0] * dp_size
        for i in heavy_first[start : start + dp_size * size]:
            r = min(
                (r for r in range(dp_size) if len(placed[r][k]) < size), key=lambda r: (cell_work[r], rank_work[r], r)
            )
            placed[r][k].append(i)
            cell_work[r] += float(work[i])
            rank_work[r] += float(work[i])
        start += dp_size * size
    order = torch.tensor([i for rank in placed for cell in rank for i in cell], dtype=torch.int64)
    before = step_cost(cells(work, dp_size=dp_size, micro_batch_size=micro_batch_size))
    if step_cost(cells(work[order], dp_size=dp_size, micro_batch_size=micro_batch_size)) >= before:
        return torch.arange(n)
    return order


@dataclass(frozen=True)
class Balancer:
    """Orders each global batch by `plan` (see module docstring).

    Args:
        model: the work estimate of a row.
        micro_batch_size: rows per forward on one dp rank (``run.micro_batch_size``).
    """

    model: WorkModel
    micro_batch_size: int

    def order(self, document_ids: Tensor, dp_size: int) -> Tensor:
        """``[N]`` permutation of a global batch of ``N`` rows given their ``[N, ..., S]`` document ids."""
        return plan(self.model.rows(document_ids), dp_size=dp_size, micro_batch_size=self.micro_batch_size)
