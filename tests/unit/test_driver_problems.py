"""Configs validate accepted that then crashed (a review ran them): a driver of runs of its own
(budget=msft, plait rest) without checkpoints, under torchft's replica groups or local SGD's islands
(an mSFT roll-back point whose islands differed), and callbacks
that read the whole model while IST trains narrower MLPs. Each is now refused, naming the fix.
Mutation: dropping driver_problems / subnet_problems from component_problems accepts all of them."""

from __future__ import annotations

import pytest
from harness import compose_config

from trainer.config import ConfigError, validate

SFT = ["model=nano", "data=synthetic", "train.global_batch_size=8"]
REST = ["model=nano", "model.max_seq_len=512"]


@pytest.mark.parametrize(
    "recipe, overrides, problem",
    [
        ("sft", [*SFT, "budget=msft", "callbacks.checkpoint=null"], "budget=msft reads the checkpoints"),
        ("sft", [*SFT, "budget=msft", "strategy=ft"], "budget=msft fits its runs in processes of its own"),
        ("rest", [*REST, "callbacks.checkpoint=null"], "plait rest reads the checkpoints"),
        ("rest", [*REST, "strategy=ft"], "plait rest fits its runs in processes of its own"),
        (
            "sft",
            [*SFT, "budget=msft", "strategy=diloco", "trainer.devices=2"],
            "budget=msft takes its runs' models from their checkpoints",
        ),
        ("rest", [*REST, "strategy=diloco", "trainer.devices=2"], "plait rest takes its runs' models from their"),
        (
            "pretrain",
            [
                "strategy=ist",
                "trainer.devices=2",
                "strategy.local_sgd.sync_every=2",
                "callbacks.hf_export.every_n_steps=1",
            ],
            "exports in the middle of an IST round",
        ),
        (
            "pretrain",
            [
                "strategy=ist",
                "trainer.devices=2",
                "strategy.local_sgd.sync_every=2",
                "callbacks.lm_eval.every_n_steps=3",
                "trainer.max_steps=8",
            ],
            "scores in the middle of an IST round",
        ),
        ("paft", ["model=nano", "strategy=ist", "trainer.devices=2", "data=synthetic"], "callbacks.delta_l1 pulls"),
    ],
)
def test_a_combination_that_crashed_is_refused(recipe: str, overrides: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides, recipe=recipe, tiny=recipe == "pretrain"))
    assert any(problem in p for p in err.value.problems), err.value.problems


def test_the_same_drivers_with_checkpoints_and_whole_round_exports_pass() -> None:
    validate(compose_config([*SFT, "budget=msft"], recipe="sft", tiny=False))
    # IST reassembles at each round's last step, before its checkpoint: rest takes one model (a reviewer)
    validate(compose_config([*REST, "strategy=ist", "trainer.devices=2"], recipe="rest", tiny=False))
    ist = ["strategy=ist", "trainer.devices=2", "strategy.local_sgd.sync_every=2"]
    validate(compose_config([*ist, "callbacks.hf_export.every_n_steps=4", "trainer.max_steps=8"]))  # whole rounds
    # a run ending inside a round exports its last step whole (reassembled first): tests/dist/test_ist_runs.py
    validate(compose_config([*ist, "callbacks.hf_export.every_n_steps=3", "trainer.max_steps=3"]))
