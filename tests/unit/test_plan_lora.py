"""``plait plan`` plans a LoRA run before its base exists (the planner needs the model's shape,
not its weights); a launch still refuses LoRA without ``model.init_from``."""

from __future__ import annotations

import pytest

from trainer import plan
from trainer.compose import compose
from trainer.config import ConfigError, validate

LORA = ["model=nano", "cluster=h100x8", "strategy/lora=default"]
NO_BASE = "strategy.lora trains adapters on a frozen base"


def test_plan_takes_lora_without_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: plait plan model=llama3_8b cluster=h100x8 +strategy/lora=default was refused for
    want of model.init_from."""
    plan.main(LORA)
    out = capsys.readouterr().out
    assert out.startswith("cluster h100x8") and "overrides: strategy=nd" in out, out


def test_a_launch_still_needs_the_base_and_planning_keeps_loras_other_checks() -> None:
    with pytest.raises(ConfigError) as launch:
        validate(compose("pretrain", LORA))
    assert any(p.startswith(NO_BASE) for p in launch.value.problems)
    with pytest.raises(ConfigError) as planned:
        validate(compose("pretrain", [*LORA, "strategy.lora.target_modules=[wq,query]"]), for_launch=False)
    assert (
        [p for p in planned.value.problems if "strategy.lora" in p]
        == [p for p in planned.value.problems if "'query' matches no linear layer" in p]
        != []
    )
