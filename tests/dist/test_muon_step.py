"""Distributed Muon below the trainer (fast; the whole runs are in test_muon_runs.py, marked slow).

On 2 gloo ranks, a tiny Llama laid out by plait's FSDP2 (`strategies.fsdp.apply_fsdp`: Shard(0)
over dp_shard; HSDP 2 x 2 on 4 ranks) or tensor parallelism (`strategies.tensor.apply_tensor_parallel`: Shard(0) / Shard(1)
over tp, the embedding and head by vocabulary) takes 2 steps of plait's Muon with given gradients
(the same full gradients on every layout, each rank its shard); its parameters equal one process'
bitwise: the momentum and AdamW are elementwise on shards and each matrix's Newton-Schulz (fp32)
runs whole on its owner. Each step exchanges the matrices in two all_to_all per batch of 2, and no
other collective. `orthogonalize` also takes matrices sharded over two mesh axes (4 ranks, 2 x 2).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from strategies.muon import Muon, newton_schulz, orthogonalize
from strategies.runtime.gloo import run_gloo_ranks
from trainer.models.llama import Llama
from trainer.optim import build_optimizer

STEPS = 2
MUON = functools.partial(Muon, lr=0.02, ns_dtype="float32")


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    model.init_weights()
    return model


def _grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}


def _train(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    optimizer = build_optimizer(model, MUON, weight_decay=0.1, no_decay=("tok_embeddings", "norm", "bias"))
    for step in range(STEPS):
        for name, p in model.named_parameters():
            g = _grads(model, step)[name]
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        optimizer.step()
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _sharded_run(layout: str, expected: dict[str, torch.Tensor]) -> tuple[list[str], int, list[str]]:
    """Names of the parameters that differ from ``expected`` after the steps, all_to_all calls, layouts."""
    from torch.distributed.device_mesh import init_device_mesh

    from strategies.fsdp import apply_fsdp
    from strategies.tensor import apply_tensor_parallel

    model = _model()
    if layout == "fsdp2":
        apply_fsdp(model, dp_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)))
    elif layout == "hsdp2x2":
        apply_fsdp(model, dp_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        apply_tensor_parallel(model, mesh, model.tp_plan(sequence_parallel=False, loss_parallel=False))
    calls, real = [], dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        params = _train(model)
    finally:
        dist.all_to_all_single = real
    placements = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor) and p.ndim == 2})
    # Compared here: tensors sent back through the result queue would travel as shared memory.
    return [n for n, t in expected.items() if not torch.equal(params[n], t)], len(calls), placements


@pytest.fixture(scope="module")
def one_process() -> dict[str, torch.Tensor]:
    return _train(_model())


PLACEMENTS = {
    "fsdp2": ["(Shard(dim=0),)"],
    "tp2": ["(Shard(dim=0),)", "(Shard(dim=1),)"],
    "hsdp2x2": ["(Replicate(), Shard(dim=0))"],  # each replica's dp_shard pair exchanges on its own
}


@pytest.mark.parametrize("layout", list(PLACEMENTS))
def test_sharded_steps_equal_one_process(layout: str, one_process) -> None:
    world = 4 if layout == "hsdp2x2" else 2
    for differ, calls, placements in run_gloo_ranks(world, lambda rank: _sharded_run(layout, one_process)):
        assert differ == []
        # 14 hidden matrices in batches of 2 (the sharding axis' size): 7 batches x 2 all_to_all per step.
        assert calls == STEPS * 7 * 2
        assert placements == PLACEMENTS[layout]


def _two_axes(rank: int) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    full = [torch.randn(8, 6) for _ in range(5)]  # a batch of 4 and one of 1
    sharded = [distribute_tensor(m, mesh, [Shard(0), Shard(1)]) for m in full]
    done = orthogonalize(sharded, steps=5, dtype=torch.float32)
    expected = [distribute_tensor(newton_schulz(m, dtype=torch.float32), mesh, [Shard(0), Shard(1)]) for m in full]
    return [torch.equal(d, e.to_local()) for d, e in zip(done, expected)]


def test_matrices_sharded_over_two_axes() -> None:
    assert all(all(ok) for ok in run_gloo_ranks(4, _two_axes))
