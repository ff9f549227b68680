"""Global gradient norm and clipping over shards, replicas and pipeline stages.

Sources: pytorch/torchtitan#766 and pytorch/pytorch#159856 (norms of sharded or partial
gradients must be reduced before clipping; cases C13 and C14 in the shared cases).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    *,
    norm_type: float = 2.0,
    stage_groups: Sequence[dist.ProcessGroup] = (),
) -> torch.Tensor:
    """Norm of the full logical gradient, identical on every rank.

    DTensor gradients (FSDP shards, TP shards, HSDP replicas) are reduced by DTensor itself
    (``full_tensor`` of the norm reduces over shard axes, counts replicas once and sums Partial
    placements before the norm). Parameters that live on other pipeline stages are not DTensor
    axes, so their contribution is all-reduced over ``stage_groups``.

    Args:
        parameters: the local parameters; those without ``.grad`` are skipped.
        norm_type: p of the p-norm; ``inf`` gives the max-norm.
        stage_groups: process groups of ranks holding *different* parameters (pp).

    Returns:
        0-dim fp32 tensor on the gradients' device (0 when there are no gradients).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        total = torch.zeros(())
    else:
        total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()
    total = total.float()
    for group in stage_groups:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grads_(parameters: Sequence[torch.nn.Parameter], *, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales all gradients by ``min(1, max_norm / total_norm)`` (the same coefficient on every rank)."""
    with_grad = [p for p in parameters if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total_norm)
