"""Expert parallelism, the ``strategy.expert_parallel`` plugin: each rank of an ``ep`` group holds
``E / ep`` experts of every MoE block (a DTensor ``Shard(0)`` of the stacked expert weights), and the
routed rows travel to them (`strategies.expert_dispatch`, or LLEP's `strategies.least_loaded`).

Sources: Lepikhin et al. 2020, "GShard"; torchtitan's expert parallelism (ep ranks borrowed from
the data-parallel ranks dp_shard x cp, expert weights sharded over ep and FSDP over the rest), read
for the approach, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from strategies.expert_dispatch import EXPERT_WEIGHTS, AllToAllDispatch, expert_modules
from strategies.least_loaded import LeastLoadedDispatch


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatch: Any = None) -> int:
    """Shards every stacked-experts module of ``model`` over ``ep_mesh`` and swaps its dispatcher.

    Each ``w1``/``w2``/``w3`` becomes a DTensor ``Shard(0)`` over the ep axis built from this
    rank's slice of the (identically initialised) full weights, so checkpoints hold the global
    ``[E, out, in]`` tensors and reshard to another ep. ``dispatch`` (default `AllToAllDispatch`
    over the ep group) replaces each module's dispatcher.

    Returns:
        the number of modules sharded.

    Raises:
        ValueError: ep does not divide a module's experts.
    """
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    dispatch = dispatch if dispatch is not None else AllToAllDispatch(ep_mesh.get_group())
    count = 0
    for experts in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            if full.shape[0] % ep:
                raise ValueError(f"ep={ep} does not divide the {full.shape[0]} experts; choose ep among their divisors")
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], shape=full.shape, stride=full.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        experts.dispatcher = dispatch
        count += 1
    return count


@dataclass
class ExpertParallel:
    """The ``strategy.expert_parallel`` plugin: ``ep`` ranks share the experts of each MoE block.

    Args:
        ep: expert-parallel degree, taken from the dp_shard x cp ranks (1: off). Must divide the
            experts of every MoE block and dp_shard x cp.
        least_loaded: LLEP (`strategies.least_loaded`): spill the most loaded ranks' excess rows,
            with copies of their experts' weights, to the least loaded ranks every step.
        capacity_ratio: LLEP's cap on a rank's rows, as a multiple of the mean (>= 1).
        min_tokens_per_gemm: LLEP moves no fewer rows than this to a helper rank.
    """

    ep: int = 1
    least_loaded: bool = False
    capacity_ratio: float = 1.1
    min_tokens_per_gemm: int = 16

    def dispatcher(self, group: dist.ProcessGroup) -> Any:
        """The row exchange this plugin installs: all-to-all, or least-loaded spilling."""
        if not self.least_loaded:
            return AllToAllDispatch(group)
        return LeastLoadedDispatch(group, capacity_ratio=self.capacity_ratio, min_tokens_per_gemm=self.min_tokens_per_gemm)

    def apply(self, model: nn.Module, ep_mesh: DeviceMesh) -> int:
        """Shards ``model``'s experts over ``ep_mesh`` (see `apply_expert_parallel`)."""
        return apply_expert_parallel(model, ep_mesh, self.dispatcher(ep_mesh.get_group()))
