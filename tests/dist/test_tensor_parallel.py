"""Tensor parallelism beyond the loss/gradient equivalence (which is in test_equivalence.py):
the collectives of one block follow the Megatron pattern, and a user's plan override is selected
from Hydra and runs.

Collective counts are taken with DTensor's ``CommDebugMode`` over one forward and one backward
of a single transformer block on 2 gloo ranks. Megatron-LM (Shoeybi et al. 2019) needs one
all-reduce per column/row-wise pair in forward (after the attention output projection and after
the MLP down projection) and one per pair in backward (the input gradient of the column-wise
projections); sequence parallelism (Korthikanti et al. 2022) turns each into an all-gather before
the pair and a reduce-scatter after it, in forward and backward alike.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from harness import compose_config, fit, losses
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from strategies.runtime.gloo import run_gloo_ranks
from strategies.tensor import TensorParallel

ALL_REDUCE = "c10d_functional.all_reduce"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"
REDUCE_SCATTER = "c10d_functional.reduce_scatter_tensor"


def _block_collectives(rank: int, sequence_parallel: bool) -> tuple[dict[str, int], dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from strategies.tensor import apply_tensor_parallel
    from trainer.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=False))
    block = model.layers["0"]
    # The residual stream entering a block: [B, T/tp, D] per rank with SP, [B, T, D] without.
    x = torch.randn(2, 8 if sequence_parallel else 16, 32, requires_grad=True)
    cos, sin = model.rope_cos[None, :, None, :], model.rope_sin[None, :, None, :]
    with CommDebugMode() as forward:
        out = block(x, cos, sin, None)
    with CommDebugMode() as backward:
        out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in block.parameters())
    counts = [{str(op): n for op, n in mode.get_comm_counts().items()} for mode in (forward, backward)]
    return counts[0], counts[1]


@pytest.mark.parametrize(
    ("sequence_parallel", "expected"),
    [(False, {ALL_REDUCE: 2}), (True, {ALL_GATHER: 2, REDUCE_SCATTER: 2})],
    ids=["tp", "tp_sp"],
)
def test_one_block_uses_the_megatron_collectives(sequence_parallel: bool, expected: dict[str, int]) -> None:
    for forward, backward in run_gloo_ranks(2, lambda rank: _block_collectives(rank, sequence_parallel)):
        assert forward == expected
        assert backward == expected


class ReplicatedHeadTP(TensorParallel):
    """A user's plan: shard the blocks as usual but keep the LM head and embedding unsharded."""

    @override
    def plan(self, model: nn.Module) -> dict[str, Any]:
        return {k: v for k, v in super().plan(model).items() if k not in ("tok_embeddings", "output")}


class LayoutProbe(L.Callback):
    """Records which weights are DTensors once the strategy has parallelized the model."""

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        sharded = sorted(n for n, p in pl_module.model.named_parameters() if isinstance(p, DTensor))
        pl_module.history.append({"sharded": sharded})


def test_user_plan_override_selected_from_hydra_trains_like_one_process(tmp_path) -> None:
    # Clipping at 0.1 is active every step (norms ~0.7), over a mix of plain-tensor weights (the
    # unsharded head and embedding) and DTensor weights: the global norm must combine both.
    common = ["optim=sgd", "scheduler=constant", "scheduler.warmup_steps=0", "train.max_grad_norm=0.1"]
    probe = f"+callbacks.probe._target_={__name__}.LayoutProbe"
    reference = fit(compose_config(common), tmp_path / "one")[1].history
    _, task = fit(
        compose_config(
            [
                *common,
                "strategy=tp",
                "trainer.devices=2",
                f"strategy.tensor_parallel._target_={__name__}.ReplicatedHeadTP",
                "strategy.tensor_parallel.sequence_parallel=false",  # a replicated head needs full-sequence input
                "strategy.tensor_parallel.loss_parallel=false",
                probe,
            ]
        ),
        tmp_path / "tp",
    )
    sharded = next(h["sharded"] for h in task.history if "sharded" in h)
    assert "layers.0.attention.wq.weight" in sharded and "layers.1.feed_forward.w2.weight" in sharded
    assert "output.weight" not in sharded and "tok_embeddings.weight" not in sharded
    assert losses(task.history) == pytest.approx(losses(reference), rel=1e-6)
    norms = [[h["grad_norm"] for h in history if "loss" in h] for history in (task.history, reference)]
    assert min(norms[1]) > 0.1 and norms[0] == pytest.approx(norms[1], rel=1e-4)
