"""float8 training (`strategies.float8`, emulated on CPU): one process and FSDP2 on 2 gloo ranks
(weights all-gathered in float8, their scales precomputed after each optimizer step) train alike.

fp32 nano Llama, the bundled corpus, global batch 8 of 64-token rows in micro-batches of 4, 3 steps
of SGD (constant LR, no clipping), tensorwise recipe. Each micro-batch casts its own activations
(one scale per tensor), so the one-process run accumulates 2 micro-batches of the same 4 rows each
FSDP rank runs; the weights' scales are the global amax under FSDP too (one all-reduce). What differs
is the order of the gradient sums (a reduce-scatter against an accumulation), hence a tolerance.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from harness import EXACT_SGD, compose_config, fit, full, losses
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

COMMON = (
    *EXACT_SGD,
    "trainer.max_steps=3",
    "train.micro_batch_size=4",
    "strategy.float8.recipe=tensorwise",
    "+callbacks.params._target_=test_float8_fsdp.ShardedParamRecorder",
)
LINEARS = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [f"feed_forward.{w}" for w in ("w1", "w2", "w3")]
TOL = {"rtol": 1e-5, "atol": 1e-6}


class ShardedParamRecorder(L.Callback):
    """``{"params": {name: full parameter}}`` at the end of training, read from the sharded
    parameters: a block FSDP left gathered (the last one, after the final evaluation) holds its
    float8 all-gather's output, the float8 values, in place of its parameters until resharded."""

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        for module in pl_module.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        # p * 1: a plain tensor of the values (the float8 all-gather's weight wrapper keeps only copies).
        params = {n: full(p.data * 1).detach() for n, p in pl_module.model.named_parameters()}
        converted = sorted(n for n, m in pl_module.model.named_modules() if isinstance(m, Float8Linear))
        all_gather = any(
            isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)
            for p in pl_module.model.parameters()
            if isinstance(p, DTensor)
        )
        pl_module.history.append({"params": params, "float8": converted, "all_gather": all_gather})


def _run(overrides: list[str], run_dir) -> dict:
    _, task = fit(compose_config([*COMMON, *overrides]), run_dir)
    (end,) = [h for h in task.history if "params" in h]
    return {"loss": losses(task.history), **end}


@pytest.mark.slow  # two float8 runs (emulated): ~90 s on 2 shared cores, past the default suite's budget
def test_float8_one_process_equals_fsdp2(tmp_path):
    one = _run([], tmp_path / "one")
    fsdp = _run(["strategy=fsdp", "trainer.devices=2"], tmp_path / "fsdp")
    blocks = sorted(f"layers.{i}.{name}" for i in (0, 1) for name in LINEARS)
    assert one["float8"] == fsdp["float8"] == blocks  # every Linear but the LM head
    assert fsdp["all_gather"] and not one["all_gather"]
    assert len(one["loss"]) == 3
    torch.testing.assert_close(fsdp["loss"], one["loss"], **TOL)
    torch.testing.assert_close(fsdp["params"], one["params"], **TOL)
