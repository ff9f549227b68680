"""QLoRA (``strategy.lora.quantize=nf4``) under FSDP2: a 2-process dp_shard fit on gloo equals the
same QLoRA fit on one process (losses, adapter gradients at every step, the packed 4-bit codes), the
loss falls, and the checkpoint holds only the adapters.

Under FSDP2 each adapted layer's NF4 codes (float32 storage) are their own FSDP unit, sharded and
all-gathered like a float parameter, and dequantised with the layer's own ``QuantState``
(`strategies.transforms.qlora.NF4Linear`). The base is test_lora's random Llama-3 Hugging Face directory.
"""

from __future__ import annotations

import pytest
import torch
from test_lora import _overrides, base  # noqa: F401 (the fixture)

from harness import compose_config, fit, losses, recorded

STEPS = 6
TOL = {"rtol": 1e-5, "atol": 1e-5}
LAYOUTS = {
    "one_process": ["train.micro_batch_size=8"],
    "fsdp2": ["strategy=fsdp", "trainer.devices=2", "train.micro_batch_size=2"],
}


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):  # noqa: F811
    overrides = [o for o in _overrides(base) if not o.startswith(("optim=", "trainer.max_steps="))]
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = compose_config([
            *overrides, "optim=adamw", "optim.lr=1e-2", f"trainer.max_steps={STEPS}", "strategy.lora.quantize=nf4", *layout,
        ])  # fmt: skip
        run_dir = tmp_path_factory.mktemp(name)
        _, task = fit(cfg, run_dir)
        out[name] = {**recorded(task.history), "run_dir": run_dir}
    return out


def test_fsdp2_qlora_equals_one_process(runs):
    one, two = runs["one_process"], runs["fsdp2"]
    print("qlora fsdp2 losses", [round(x, 4) for x in two["loss"]])
    torch.testing.assert_close(two["loss"], one["loss"], **TOL, msg="losses")
    assert len(two["loss"]) == STEPS and two["loss"][-1] < two["loss"][0] - 0.05, two["loss"]
    assert len(two["grads"]) == STEPS
    for step, (got, expected) in enumerate(zip(two["grads"], one["grads"]), 1):
        assert set(got) == set(expected) and all(".lora_" in n for n in got), "only the adapters have gradients"
        torch.testing.assert_close(got, expected, **TOL, msg=f"adapter gradients at step {step}")
    wq = two["params"]["layers.0.attention.wq.weight"]
    assert wq.dtype == torch.float32 and tuple(wq.shape) == (64 * 64 // 8, 1), "packed NF4 codes, 8 per float32"
    for name, codes in one["params"].items():
        if ".lora_" not in name:
            assert torch.equal(two["params"][name].view(torch.int32), codes.view(torch.int32)), f"{name}: the base differs"


def test_fsdp2_qlora_checkpoint_holds_only_the_adapters(runs):
    from strategies.checkpoint.dcp import saved_entries
    from trainer.rundir import resolve_checkpoint

    ckpt = resolve_checkpoint(runs["fsdp2"]["run_dir"])
    assert set(saved_entries(ckpt, "model.")) == set(runs["fsdp2"]["grads"][0]), "model state: the adapters only"


def test_fsdp2_qlora_with_bf16_params_gathers_the_codes_uncast(runs, base, tmp_path):  # noqa: F811
    """strategy.fsdp.param_dtype=bf16 casts the gathered float parameters, never the packed codes
    (a cast would turn them into other codes): two steps stay within bf16 rounding of the fp32 run."""
    overrides = [o for o in _overrides(base) if not o.startswith(("optim=", "trainer.max_steps="))]
    cfg = compose_config([
        *overrides, "optim=adamw", "optim.lr=1e-2", "trainer.max_steps=2", "strategy.lora.quantize=nf4",
        *LAYOUTS["fsdp2"], "strategy.fsdp.param_dtype=bf16",
    ])  # fmt: skip
    _, task = fit(cfg, tmp_path)
    loss = losses(task.history)
    print("qlora fsdp2 bf16 losses", [round(x, 4) for x in loss], "fp32", [round(x, 4) for x in runs["one_process"]["loss"][:2]])
    torch.testing.assert_close(loss, runs["one_process"]["loss"][:2], rtol=0, atol=2e-2, msg="bf16 losses")
