"""``trainer.precision=bf16-true`` (weights and the default dtype bfloat16, as LitGPT's flag) with each
objective that keeps named sums: SFT's per-source losses made their table in the default dtype and
crashed at the first evaluation (``index_add_(): self (BFloat16) and source (Float)``: a reviewer
following docs/coming-from.md). The sums are fp32 now, in every objective, and the runs train.
Mutation: SFT's table back to ``torch.zeros(2, G)`` (the default dtype) -> the sft case crashes."""

from __future__ import annotations

import math

import pytest
from harness import fit

from trainer.compose import compose

SMALL = ["model=nano", "trainer.precision=bf16-true", "trainer.max_steps=2", "train.eval_every=1", "logger=none"]
CASES = {
    "sft": ("sft", ["data=synthetic", *(f"data.sources.{s}.{k}={v}" for s in ("reversal", "sorting", "addition") for k, v in (("limit", 32), ("val_size", 8), ("metric", "loss")))]),
    "dpo": ("dpo", ["data=preference_synthetic", "data.seq_len=32", "data.max_prompt_len=16", "data.sources.copy.limit=64"]),
    "kto": ("kto", ["train.global_batch_size=8", "data.seq_len=64", "data.max_prompt_len=32", "data.sources.general.limit=64", "data.sources.general.val_size=8"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_named_sums_are_fp32_under_bf16_true(case: str, tmp_path) -> None:
    recipe, overrides = CASES[case]
    cfg = compose(recipe, [*SMALL, "~callbacks.plots", "callbacks.checkpoint=null", *overrides])
    _, task = fit(cfg, tmp_path)
    named = {k: v for h in task.history for k, v in h.items() if k.startswith(("train/", "val/")) and "/" in k[4:]}
    named.update({k: v for h in task.history for k, v in h.get("metrics", {}).items()})
    assert named, task.history  # per-source losses, rewards, KTO's metrics
    assert all(math.isfinite(float(v)) for v in named.values()), named
    assert math.isfinite([h["val_loss"] for h in task.history if "val_loss" in h][-1])
