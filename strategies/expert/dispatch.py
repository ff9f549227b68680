"""The row exchange of expert parallelism: routed rows travel to the ep rank holding their expert
and back with all-to-all collectives (`AllToAllDispatch`), plus the helpers LLEP shares.

Sources: Lepikhin et al. 2020, "GShard" (experts sharded over devices, all-to-all dispatch and
combine); Rajbhandari et al. 2022, "DeepSpeed-MoE"; torchtitan's expert parallelism (the ep
ranks borrowed from the data-parallel ranks dp_shard x cp, expert weights sharded over ep and
FSDP over the remaining ranks) and Megatron-LM's all-to-all token dispatcher (counts first, then
the rows, then a regroup by local expert), read for the approach, not copied.

Works with any module that looks like ``trainer.models.moe.GroupedExperts`` (stacked ``w1``,
``w2``, ``w3`` ``[E, out, in]`` parameters, a ``dispatcher`` attribute and
``compute(x, counts, weights)``); strategies never import the model room. The row exchange uses
``torch.distributed._functional_collectives.all_to_all_single_autograd``, whose backward is the
reverse exchange, so gradients flow back to the ranks that sent the rows.

Shape suffixes: M routed rows, D model dim, E experts, R ep ranks, J experts per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

EXPERT_WEIGHTS = ("w1", "w2", "w3")


@runtime_checkable
class StackedExperts(Protocol):
    """What expert parallelism needs of an experts module (``trainer.models.moe.GroupedExperts``):
    ``w1``, ``w3`` ``[E, F, D]`` and ``w2`` ``[E, D, F]`` parameters, ``weight_names`` (every
    stacked ``[E, ...]`` parameter, these three first, then any biases, in ``compute``'s order),
    a swappable ``dispatcher`` and the grouped computation on rows sorted by expert."""

    w1: nn.Parameter
    w2: nn.Parameter
    w3: nn.Parameter
    weight_names: tuple[str, ...]
    dispatcher: Any

    def compute(
        self, x_md: torch.Tensor, counts_e: torch.Tensor, weights: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor: ...


def expert_modules(model: nn.Module) -> Iterator[Any]:
    """The stacked-experts modules of ``model``."""
    return (m for m in model.modules() if isinstance(m, StackedExperts))


def local_weights(experts: Any) -> tuple[torch.Tensor, ...]:
    """This rank's slices ``[J, ...]`` of the stacked tensors, in ``weight_names`` order: ``(w1, w2,
    w3)`` and any biases (differentiable: gradients reach the shards)."""
    weights = (getattr(experts, name) for name in experts.weight_names)
    return tuple(w.to_local() if isinstance(w, DTensor) else w for w in weights)


def source_major_to_expert_major(counts_rj: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows laid out by (source rank, expert) into (expert, source rank) order.

    ``counts_rj[r, j]`` rows came from rank r for local expert j, source-major (as an all-to-all
    delivers them); the result gathers them expert-major, the grouped GEMM's order.
    """
    flat = counts_rj.reshape(-1)
    starts_rj = (torch.cumsum(flat, 0) - flat).view_as(counts_rj)
    sizes, starts = counts_rj.T.reshape(-1), starts_rj.T.reshape(-1)
    total = int(flat.sum())
    offsets = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes)
    return offsets + torch.arange(total, device=counts_rj.device)


def exchange_counts(counts_rj: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[R, J]`` rows this rank sends to each rank's experts -> ``[R, J]`` rows each rank sends here."""
    received = torch.empty_like(counts_rj)
    dist.all_to_all_single(received, counts_rj.contiguous(), group=group)
    return received


def counts_load() -> bool:
    """Whether a dispatch now is a training forward's (its rows count in ``ep/max_over_mean_rows``):
    not an evaluation's, a rollout's or reference scoring (no grad), nor activation checkpointing's
    recompute inside the backward pass (the autograd engine runs a graph task: it counted twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class AllToAllDispatch:
    """Standard expert parallelism: rows go to the owner of their expert (experts ``r*J .. r*J+J-1``
    live on ep rank r), run there as one grouped GEMM, and come back.

    Records, per call, the rows each ep rank computed (``[R]``; see `pop_rank_loads`).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank_loads: list[torch.Tensor] = []

    def pop_rank_loads(self) -> torch.Tensor | None:
        """``[calls, R]`` rows computed per ep rank since the last pop (every rank the same), or None."""
        loads, self.rank_loads = self.rank_loads, []
        return torch.stack(loads) if loads else None

    def __call__(self, x_md: torch.Tensor, counts_e: torch.Tensor, experts: Any) -> torch.Tensor:
        send_rj = counts_e.view(self.ep, -1)
        recv_rj = exchange_counts(send_rj, self.group)
        send, recv = send_rj.sum(1).tolist(), recv_rj.sum(1).tolist()
        x_recv = funcol.all_to_all_single_autograd(x_md, recv, send, self.group)
        order = source_major_to_expert_major(recv_rj)
        y = experts.compute(x_recv[order], recv_rj.sum(0), local_weights(experts))
        y_recv = torch.empty_like(y).index_copy(0, order, y) if y.numel() else y
        if counts_load():
            self.rank_loads.append(rank_loads(send_rj.sum(1), self.group))
        return funcol.all_to_all_single_autograd(y_recv, send, recv, self.group)


def rank_loads(sent_r: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Rows every ep rank receives, from the rows this rank sends to each (one small all-reduce)."""
    loads = sent_r.detach().clone()
    dist.all_reduce(loads, group=group)
    return loads
