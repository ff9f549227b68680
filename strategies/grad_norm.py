"""Global gradient norm and clipping over shards, replicas and pipeline stages.

Sources: pytorch/torchtitan#766 and pytorch/pytorch#159856 (norms of sharded or partial
gradients must be reduced before clipping; cases C13 and C14 in the shared cases).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from strategies.runtime.collective_device import collective_device


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
        0-dim fp32 tensor on the gradients' device, or on the device of the process groups'
        backend when that cannot hold them (`strategies.runtime.collective_device`: FSDP's CPU offload
        under NCCL gives the GPU); 0 when there are no gradients.
    """
    norms = []
    for grads in _grads_by_layout(parameters).values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        if isinstance(norm, DTensor):  # host shards (FSDP CPU offload): reduce where the mesh's backend runs
            norm = norm.to(collective_device(norm.device_mesh.get_group(0), norm.device)).full_tensor()
        norms.append(norm.float())
    if not norms:
        total = torch.zeros(())
    elif norm_type == float("inf"):
        total = torch.stack(norms).max()
    else:
        total = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
    for group in stage_groups:
        total = total.to(collective_device(group, total.device))
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
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grads in _grads_by_layout(parameters).values():
        if any(isinstance(g, DTensor) for g in grads):
            with implicit_replication():  # the 0-dim coefficient is the same on every rank
                torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        else:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))


def _grads_by_layout(parameters: Iterable[torch.nn.Parameter]) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements); plain tensors under the key None.

    DTensor ops need one mesh and layout per call: with tensor parallelism some weights are
    sharded, some replicated, and some are plain tensors.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
    return groups
