"""Expert parallelism, the ``strategy.expert_parallel`` plugin: each rank of an ``ep`` group holds
``E / ep`` experts of every MoE block (a DTensor ``Shard(0)`` of the stacked expert weights), and the
routed rows travel to them (`strategies.expert.dispatch`, or LLEP's `strategies.expert.least_loaded`).

Sources: Lepikhin et al. 2020, "GShard"; torchtitan's expert parallelism (ep ranks borrowed from
the data-parallel ranks dp_shard x cp, expert weights sharded over ep and FSDP over the rest), read
for the approach, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from strategies.core.parallel_dims import Meshes
from strategies.expert.dispatch import AllToAllDispatch, expert_modules
from strategies.expert.least_loaded import LeastLoadedDispatch
from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatch: Any = None) -> int:
    """Shards every stacked-experts module of ``model`` over ``ep_mesh`` and swaps its dispatcher.

    Each stacked tensor (``weight_names``: ``w1``/``w2``/``w3`` and any expert biases) becomes a
    DTensor ``Shard(0)`` over the ep axis built from this rank's slice of the (identically
    initialised) full weights, so checkpoints hold the global ``[E, ...]`` tensors and reshard to
    another ep. ``dispatch`` (default `AllToAllDispatch`
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
        for name in experts.weight_names:
            full = getattr(experts, name)
            if full.shape[0] % ep:
                raise ValueError(f"ep={ep} does not divide the {full.shape[0]} experts; choose ep among their divisors")
            local = full.detach().chunk(ep, dim=0)[rank].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], shape=full.shape, stride=full.stride())
            setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        experts.dispatcher = dispatch
        count += 1
    return count


def expert_mesh(root: DeviceMesh, ep: int) -> DeviceMesh:
    """The mesh of the expert weights: the root mesh's (pp, dp_replicate, dp_shard, cp, tp) with
    dp_shard x cp split into ``efsdp`` (FSDP of the expert weights) x ``ep`` (expert parallelism).

    An ep group is ``ep`` consecutive ranks of dp_shard x cp (cp ranks first), as in torchtitan;
    building the mesh creates the process groups of its axes (every rank calls it).
    """
    pp, dp_replicate, dp_shard, cp, tp = root.mesh.shape
    ranks = root.mesh.reshape(pp, dp_replicate, dp_shard * cp // ep, ep, tp)
    return DeviceMesh(root.device_type, ranks, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))


# Pipeline schedules that run a stage's backward as separate input- and weight-gradient passes.


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ExpertParallel(StrategyPlugin):
    """The ``strategy.expert_parallel`` plugin: ``ep`` ranks share the experts of each MoE block.

    Applied after tensor and context parallelism and before activation checkpointing and FSDP:
    it shards the experts over ep and gives them their own FSDP over the remaining data-parallel
    ranks (``efsdp``, times dp_replicate for HSDP), which the blocks' FSDP then leaves alone.

    Args:
        ep: expert-parallel degree, taken from the dp_shard x cp ranks (1: off). Must divide the
            experts of every MoE block and dp_shard x cp.
        least_loaded: LLEP (`strategies.expert.least_loaded`): spill the most loaded ranks' excess rows,
            with copies of their experts' weights, to the least loaded ranks every step.
        capacity_ratio: LLEP's cap on a rank's rows, as a multiple of the mean (>= 1).
        min_tokens_per_gemm: LLEP moves no fewer rows than this to a helper rank.
    """

    ep: int = 1
    least_loaded: bool = False
    capacity_ratio: float = 1.1
    min_tokens_per_gemm: int = 16
    _dispatch: Any = field(default=None, init=False, repr=False)  # the dispatcher apply installed

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """ep against the borrowed ranks and the model's experts; [] when ep is 1 and LLEP is off."""
        out = []
        if self.capacity_ratio < 1 or self.min_tokens_per_gemm < 1:
            out.append(
                f"strategy.expert_parallel.capacity_ratio={self.capacity_ratio} must be >= 1 and "
                f"min_tokens_per_gemm={self.min_tokens_per_gemm} >= 1"
            )
        experts = shape.num_experts if shape is not None else 0
        if self.ep == 1:
            return out
        borrowed = run.dims.dp_shard * run.dims.cp
        if not experts:
            return [
                *out,
                f"strategy.expert_parallel.ep={self.ep} needs a mixture-of-experts model (model=moe_tiny, ...)",
            ]
        if self.ep < 1 or borrowed % self.ep or experts % self.ep:
            valid = [d for d in _divisors(borrowed) if experts % d == 0]
            out.append(
                f"strategy.expert_parallel.ep={self.ep} must divide dp_shard x cp = {borrowed} and "
                f"model.num_experts={experts}; valid ep: {', '.join(map(str, valid))}"
            )
        return out

    def dispatcher(self, group: dist.ProcessGroup) -> Any:
        """The row exchange this plugin installs: all-to-all, or least-loaded spilling."""
        if not self.least_loaded:
            return AllToAllDispatch(group)
        return LeastLoadedDispatch(
            group, capacity_ratio=self.capacity_ratio, min_tokens_per_gemm=self.min_tokens_per_gemm
        )

    def apply(self, model: nn.Module, meshes: Meshes) -> int:
        """Shards ``model``'s experts over the ep axis of `expert_mesh` (`apply_expert_parallel`)
        and gives each experts module its own FSDP over ``efsdp`` (with dp_replicate when the
        blocks' FSDP mesh has it: HSDP), with the policies of the run's FSDP plugin
        (``meshes.plugins["fsdp"]``); returns the modules sharded (0 when ep is 1)."""
        if self.ep == 1:
            return 0
        mesh = expert_mesh(meshes.root, self.ep)
        self._dispatch = self.dispatcher(mesh["ep"].get_group())
        count = apply_expert_parallel(model, mesh["ep"], self._dispatch)
        replicate = "dp_replicate" in (meshes.fsdp.mesh_dim_names or ())
        fsdp_mesh = mesh["dp_replicate", "efsdp"] if replicate else mesh["efsdp"]
        fsdp = meshes.plugins["fsdp"]
        for experts in expert_modules(model):
            fsdp.shard_module(experts, fsdp_mesh)
        return count

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """`rank_load_metrics`."""
        return self.rank_load_metrics()

    def rank_load_metrics(self) -> dict[str, torch.Tensor]:
        """``ep/max_over_mean_rows``: the mean over this step's MoE calls of the most loaded ep
        rank's rows over the mean rank's (1 is balanced; 0-dim, on the device: the Task reads it
        with the step's other values); {} when nothing ran."""
        loads = self._dispatch.pop_rank_loads() if self._dispatch is not None else None
        if loads is None:
            return {}
        ratio = loads.float().max(1).values / loads.float().mean(1).clamp(min=1.0)
        return {"ep/max_over_mean_rows": ratio.mean()}
