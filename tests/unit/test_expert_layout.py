"""Expert-parallel layouts that cannot run are refused by `validate`, before any process starts,
each problem naming the degrees that would work."""

from __future__ import annotations

import pytest
from harness import MOE_SMALL, compose_config

from trainer.config import ConfigError, validate

FOUR_RANKS = (*MOE_SMALL, "strategy=nd", "trainer.devices=4", "train.global_batch_size=16")


CASES = {  # id: (overrides, message)
    "ep_not_dividing_experts_or_ranks": (
        ["strategy.expert_parallel.ep=3"], "ep=3 must divide dp_shard x cp = 4 and model.num_experts=4; valid ep: 1, 2, 4"),
    "ep_above_the_ranks": (
        ["strategy.expert_parallel.ep=8", "model.num_experts=8"],
        "ep=8 must divide dp_shard x cp = 4 and model.num_experts=8; valid ep: 1, 2, 4"),
    "ep_above_dp_shard_under_tp": (
        ["strategy.expert_parallel.ep=4", "strategy.tp=2", "model.num_experts=8"],
        "ep=4 must divide dp_shard x cp = 2 and model.num_experts=8; valid ep: 1, 2"),
    "top_k_above_experts": (["model.top_k=5"], "model.top_k=5 exceeds model.num_experts=4; valid top_k: 1..4"),
    "capacity_below_1": (["strategy.expert_parallel.capacity_ratio=0.5"], "capacity_ratio=0.5 must be >= 1"),
    "split_backward_schedule": (
        ["strategy.pp=2", "strategy.pipeline.schedule=ZBV", "train.micro_batch_size=1"],
        "use strategy.pipeline.schedule=1F1B, GPipe or Interleaved1F1B"),
}  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), list(CASES.values()), ids=list(CASES))
def test_bad_expert_layouts_fail_in_validate(overrides, message):
    with pytest.raises(ConfigError, match="valid|must be|use strategy") as info:
        validate(compose_config([*FOUR_RANKS, *overrides]))
    assert message in str(info.value)


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["strategy=nd", "trainer.devices=2", "strategy.expert_parallel.ep=2"]))
    assert "strategy.expert_parallel.ep=2 needs a mixture-of-experts model" in str(info.value)


def test_a_valid_layout_resolves_with_the_experts_in_the_shape():
    run = validate(compose_config([*FOUR_RANKS, "strategy.expert_parallel.ep=4"]))
    assert (run.shape.num_experts, run.shape.top_k, run.shape.moe_ffn_dim) == (4, 2, 32)
