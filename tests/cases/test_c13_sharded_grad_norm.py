"""Case C13 — gradient norm of sharded gradients computed or reported per rank
(pytorch/torchtitan#766; related pytorch/pytorch#170862, #159856, pytorch/torchtune#2240).

Scenario: logical gradient [3, 0, 0, 4] sharded over 2 ranks as [3, 0] | [0, 4]; max_norm=1.
Expected: `global_grad_norm` reports 5.0 on every rank; clip coefficient 0.2 on every rank; clipped
gradient [0.6, 0, 0, 0.8]. Clipping by the local norm gives [1, 0 | 0, 1] (norm 1.414, direction
changed). Variants: Partial(sum) gradients rank0 [1, 3] + rank1 [2, 1] = logical [3, 4] give 5.0;
with HSDP replicate=2 (mesh 2x2, Replicate x Shard) the norm stays 5.0, not 5*sqrt(2) = 7.07.
Each variant also runs on gradients that plait's own FSDP2 (`apply_fsdp`) produced by a backward.

Real gloo processes, forked, one process group per test (`strategies.runtime.gloo.run_gloo_ranks`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from strategies.fsdp import apply_fsdp
from strategies.grad_norm import clip_grads_, global_grad_norm
from strategies.runtime.gloo import run_gloo_ranks

LOGICAL = torch.tensor([3.0, 0.0, 0.0, 4.0])
CLIPPED = [0.6, 0.0, 0.0, 0.8]


def norm_and_clip(param: nn.Parameter) -> dict[str, Any]:
    """plait's norm and clip (what MeshStrategy.grad_norm / clip_grads run) on one parameter."""
    before = param.grad.to_local().clone()
    total = global_grad_norm([param])
    clip_grads_([param], max_norm=1.0, total_norm=total)
    after = param.grad.to_local()
    nonzero = before != 0
    return {
        "norm": total.item(),
        "coefficient": (after[nonzero] / before[nonzero]).unique().tolist(),
        "clipped": param.grad.full_tensor().tolist(),
    }


def clip_then_full(param: nn.Parameter) -> list[float]:
    clip_grads_([param], max_norm=1.0, total_norm=global_grad_norm([param]))
    return param.grad.full_tensor().tolist()


def dtensor_grad(mesh: Any, local: torch.Tensor, placements: list[Any]) -> nn.Parameter:
    param = nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, placements))
    param.grad = DTensor.from_local(local, mesh, placements)
    return param


class Scale(nn.Module):
    """loss = w . g for one [4] parameter w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()


class Vector(nn.Module):
    """`Scale` as the one block in ``layers``, the structure `apply_fsdp` shards."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Scale()])

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return self.layers[0](g)


def fsdp_grad(mesh: Any, rank: int) -> nn.Parameter:
    """The gradient [3, 0, 0, 4] produced by plait's FSDP2 (sum reduction): only rank 0 has data."""
    model = Vector()
    apply_fsdp(model, dp_mesh=mesh)
    model(LOGICAL if rank == 0 else torch.zeros(4)).backward()
    param = model.layers[0].w
    assert param.grad.full_tensor().tolist() == LOGICAL.tolist()
    return param


def assert_norm_5_everywhere(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["norm"] == pytest.approx(5.0, abs=1e-6), (rank, result)
        assert result["coefficient"] == pytest.approx([0.2], abs=1e-6), (rank, result)
        assert result["clipped"] == pytest.approx(CLIPPED, abs=1e-6), (rank, result)


def test_shard0_gradient_norm_is_global_on_every_rank() -> None:
    def run(rank: int) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2,))
        local = LOGICAL[2 * rank : 2 * rank + 2].clone()  # [3, 0] | [0, 4]
        manual = norm_and_clip(dtensor_grad(mesh, local, [Shard(0)]))
        return {"manual": manual, "fsdp": norm_and_clip(fsdp_grad(mesh, rank))}

    results = run_gloo_ranks(2, run)
    assert_norm_5_everywhere([r["manual"] for r in results])
    assert_norm_5_everywhere([r["fsdp"] for r in results])


def test_partial_sum_gradient_is_summed_before_the_norm() -> None:
    def run(rank: int) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2,))
        param = dtensor_grad(mesh, torch.tensor([[1.0, 3.0], [2.0, 1.0]])[rank].clone(), [Partial("sum")])
        return {"norm": global_grad_norm([param]).item(), "clipped": clip_then_full(param)}

    for rank, result in enumerate(run_gloo_ranks(2, run)):
        assert result["norm"] == pytest.approx(5.0, abs=1e-6), rank  # not |[1,3]| = 3.16 or |[2,1]| = 2.24
        assert result["clipped"] == pytest.approx([0.6, 0.8], abs=1e-6), rank


def test_hsdp_replicas_are_counted_once() -> None:
    def run(rank: int) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        shard = mesh["dp_shard"].get_local_rank()
        local = LOGICAL[2 * shard : 2 * shard + 2].clone()
        manual = norm_and_clip(dtensor_grad(mesh, local, [Replicate(), Shard(0)]))
        return {"manual": manual, "fsdp": norm_and_clip(fsdp_grad(mesh, rank))}

    results = run_gloo_ranks(4, run)
    assert_norm_5_everywhere([r["manual"] for r in results])  # not 5 * sqrt(2) = 7.07
    assert_norm_5_everywhere([r["fsdp"] for r in results])
