"""Sparsity-accelerated training (`strategies.sat`): dense at rate 0, and at rate 0.5 one process
and FSDP on 2 ranks equal an independent reference that zeroes the omitted channels.

fp32 nano Llama, the bundled corpus, global batch 8 of 64-token rows, 3 steps of SGD with momentum
(constant LR, no clipping). plait gathers the kept rows of w1/w3 and columns of w2 and runs smaller
matmuls; the reference loop written here keeps the dense matmuls and multiplies the MLP's hidden
activation by a 0/1 channel mask, so the omitted channels contribute nothing and get zero gradient
through autograd. The kept channels come from plait's `kept_channels` (the random draw is shared on
purpose: the reference checks the omission and its gradient, not the random numbers).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from harness import EXACT_SGD, compose_config, fit, losses, reference_setup
from strategies.sat import SAT, kept_channels
from trainer.data.packing import IGNORE_INDEX

STEPS = 3
RATE = 0.5
TOL = {"rtol": 1e-5, "atol": 1e-6}
COMMON = (*EXACT_SGD, f"trainer.max_steps={STEPS}", "+callbacks.params._target_=harness.ParamRecorder")
SAT_ON = ("+strategy/sat=default", "strategy.sat.seed=5")


def _run(overrides: list[str], run_dir) -> dict:
    _, task = fit(compose_config([*COMMON, *overrides]), run_dir)
    return {"loss": losses(task.history), "params": [h["params"] for h in task.history if "params" in h][0]}


def _masked_forward(ff: torch.nn.Module, mask_f: list[torch.Tensor]):
    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_btd)) * self.w3(x_btd) * mask_f[0])

    return types.MethodType(forward, ff)


def reference(rate: float) -> dict:
    cfg = compose_config([*COMMON, *SAT_ON])
    rows, model, optimizer, sampler = reference_setup(cfg)
    masks = {}
    for i, block in model.layers.items():
        masks[i] = [torch.ones(block.feed_forward.ffn_dim)]
        block.feed_forward.forward = _masked_forward(block.feed_forward, masks[i])
    out = {"loss": []}
    for step, index in zip(range(STEPS), sampler):
        for i, block in model.layers.items():
            kept = kept_channels(block.feed_forward.ffn_dim, rate, seed=5, step=step, name=f"layers.{i}.feed_forward")
            masks[i][0] = torch.zeros(block.feed_forward.ffn_dim).index_fill_(0, kept, 1.0)
        labels = rows.labels[index]
        logits = model(rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        out["loss"].append(loss.item())
        optimizer.step()
    out["params"] = {n: w.detach().clone() for n, w in model.named_parameters()}
    return out


def test_rate0_trains_exactly_as_dense(tmp_path):
    dense = _run(["train.micro_batch_size=4"], tmp_path / "dense")
    off = _run(["train.micro_batch_size=4", *SAT_ON, "strategy.sat.rate=0.0"], tmp_path / "rate0")
    assert dense["loss"] == off["loss"]
    for name, w in dense["params"].items():
        assert torch.equal(w, off["params"][name]), name


@pytest.mark.parametrize("layout", [["train.micro_batch_size=4"], ["strategy=fsdp", "trainer.devices=2"]], ids=["one_process_ga2", "fsdp2"])
def test_sat_equals_reference(tmp_path, layout):
    expected = reference(RATE)
    run = _run([*layout, *SAT_ON, f"strategy.sat.rate={RATE}"], tmp_path)
    torch.testing.assert_close(run["loss"], expected["loss"], **TOL)
    torch.testing.assert_close(run["params"], expected["params"], **TOL)


def test_channels_are_cleared_after_the_step():
    """Evaluation between steps runs the dense MLP."""
    from trainer.models.block import FeedForward

    ff = FeedForward(8, 16)
    sat = SAT(rate=0.5)
    sat.apply(torch.nn.ModuleDict({"ff": ff}))
    with sat.step(3):
        assert ff.kept_f is not None and ff.kept_f.numel() == 8
    assert ff.kept_f is None
