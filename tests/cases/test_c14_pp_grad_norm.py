"""Case C14 — gradient clipping under pipeline parallelism uses each stage's own norm
(pytorch/torchtitan#596, fix PR #649).

Scenario: 2 stages with gradient norm 6 on stage 0 and 8 on stage 1; max_norm=5.
Expected: global norm 10 on every rank, clip coefficient 0.5 on both stages. The fault (each stage
clipped by its own norm) gives norms 6 and 8 and coefficients 5/6 = 0.833 and 5/8 = 0.625; the
test shows those per-stage values are what the stage-local norm would give. The same holds with
several stages per rank (interleaved: rank 0 holds stages 0 and 2), with FSDP-sharded stages (pp=2
x dp_shard=2), and for the inf-norm (global 8 = the max over stages, coefficient 5/8 on both).

The norm and clip are `MeshStrategy.grad_norm` / `clip_grads`, what the Task calls, on a real
(pp, dp_shard) mesh of forked gloo ranks. Last, a PP fit with clipping active equals one process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from harness import compose_config, fit, losses
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from strategies.core.parallel_dims import ParallelDims
from strategies.grad_norm import global_grad_norm
from strategies.mesh import MeshStrategy
from strategies.runtime.gloo import run_gloo_ranks

# Gradients of each rank's parameters. Stage norms: 6 (stage 0 / rank 0) and 8 (stage 1 / rank 1).
ONE_STAGE_PER_RANK = {0: [[6.0, 0.0]], 1: [[0.0, 8.0]]}
# Interleaved, 4 stages: rank 0 holds stages 0 and 2 (|[3.6]|, |[4.8]|: together 6), rank 1 stages
# 1 and 3 (|[6.4]|, |[4.8]|: together 8).
TWO_STAGES_PER_RANK = {0: [[3.6], [4.8]], 1: [[6.4], [4.8]]}


def strategy_on_mesh(pp: int, dp_shard: int) -> MeshStrategy:
    """A MeshStrategy with its (pp, ..., dp_shard, ...) mesh built on the running gloo group."""
    strategy = MeshStrategy(ParallelDims(pp=pp, dp_shard=dp_shard), launcher="fork")
    strategy.dims = strategy.dims.resolve(pp * dp_shard)
    strategy._device_mesh, strategy._mesh_views = strategy.dims.build_mesh("cpu")
    return strategy


def norm_and_clip(strategy: MeshStrategy, grads: list[torch.Tensor], norm_type: float) -> dict[str, Any]:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    local = global_grad_norm(params, norm_type=norm_type).item()  # the fault: this stage's norm only
    total = strategy.grad_norm(params, norm_type=norm_type)
    strategy.clip_grads(params, max_norm=5.0, total_norm=total)
    coefficients = {round(c, 5) for p, g in zip(params, grads) for c in (p.grad[g != 0] / g[g != 0]).tolist()}
    return {"local": local, "norm": total.item(), "coefficients": coefficients}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("layout", [ONE_STAGE_PER_RANK, TWO_STAGES_PER_RANK], ids=["1f1b", "interleaved"])
def test_global_norm_and_one_coefficient_on_every_stage(layout, norm_type) -> None:
    def run(rank: int) -> dict[str, Any]:
        return norm_and_clip(strategy_on_mesh(2, 1), [torch.tensor(g) for g in layout[rank]], norm_type)

    results = run_gloo_ranks(2, run)
    if norm_type == 2.0:
        local, expected_norm = [6.0, 8.0], 10.0
    else:  # the max entry: 6 and 8 (one stage per rank); 4.8 and 6.4 (interleaved)
        local = [max(max(g) for g in layout[rank]) for rank in (0, 1)]
        expected_norm = max(local)
    for rank, result in enumerate(results):
        assert result["local"] == pytest.approx(local[rank], abs=1e-5), "the per-stage norm the fault clips by"
        assert result["norm"] == pytest.approx(expected_norm, abs=1e-5), rank
        assert len(result["coefficients"]) == 1, rank
        assert result["coefficients"].pop() == pytest.approx(5.0 / expected_norm, abs=1e-5), rank
    if norm_type == 2.0 and layout is ONE_STAGE_PER_RANK:
        assert [5.0 / r["local"] for r in results] == pytest.approx([0.8333, 0.625], abs=1e-4)  # the fault


def test_fsdp_sharded_stages() -> None:
    """pp=2 x dp_shard=2: each stage's [2] gradient is sharded over its 2 dp ranks."""

    def run(rank: int) -> dict[str, Any]:
        strategy = strategy_on_mesh(2, 2)
        stage, shard = strategy.submesh("pp").get_local_rank(), strategy.submesh("dp_shard").get_local_rank()
        logical = torch.tensor(ONE_STAGE_PER_RANK[stage][0])
        mesh = strategy.submesh("dp_shard")
        param = nn.Parameter(DTensor.from_local(torch.zeros(1), mesh, [Shard(0)]))
        param.grad = DTensor.from_local(logical[shard : shard + 1].clone(), mesh, [Shard(0)])
        total = strategy.grad_norm([param])
        strategy.clip_grads([param], max_norm=5.0, total_norm=total)
        return {"norm": total.item(), "clipped": param.grad.full_tensor().tolist(), "logical": logical.tolist()}

    for rank, result in enumerate(run_gloo_ranks(4, run)):
        assert result["norm"] == pytest.approx(10.0, abs=1e-5), rank
        assert result["clipped"] == pytest.approx([0.5 * g for g in result["logical"]], abs=1e-5), rank


def test_pp_fit_with_clipping_equals_one_process(tmp_path) -> None:
    """1F1B on 2 stages, max_grad_norm far below the raw norm: the same clipped step as one process."""
    corpus = tmp_path / "corpus.jsonl"  # small: its tokenizer trains in a moment
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i} of a small corpus " * (i % 7 + 1)}) + "\n" for i in range(400))
    )
    common = [
        f"data.path={corpus}",
        "model.n_layers=4", "optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0.05",
        "trainer.max_steps=2", "train.micro_batch_size=2", "+callbacks.grads._target_=harness.GradRecorder",
    ]  # fmt: skip
    runs = {}
    for name, layout in {"one": [], "pp": ["strategy=pp", "trainer.devices=2"]}.items():
        _, task = fit(compose_config([*common, *layout]), tmp_path / name)
        runs[name] = task.history
    norms = {name: [h["grad_norm"] for h in history if "loss" in h] for name, history in runs.items()}
    assert min(norms["one"]) > 0.5, "clipping must be active (raw norm >> 0.05)"
    assert norms["pp"] == pytest.approx(norms["one"], rel=1e-4)
    assert losses(runs["pp"]) == pytest.approx(losses(runs["one"]), abs=1e-5)
    grads = {name: [h["grads"] for h in history if "grads" in h] for name, history in runs.items()}
    torch.testing.assert_close(grads["pp"], grads["one"], rtol=1e-5, atol=1e-6)
