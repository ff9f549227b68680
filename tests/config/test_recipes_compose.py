"""Every bundled recipe composes and validates with every strategy preset, at 1 and 2 processes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from harness import compose_config

from trainer.cli import CONF_DIR, bundled_recipes
from trainer.config import validate

STRATEGIES = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))
RECIPES = sorted(bundled_recipes())


def test_there_is_something_to_compose() -> None:
    assert "pretrain" in RECIPES and {"ddp", "fsdp"} <= set(STRATEGIES)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_x_strategy_validates(recipe: str, strategy: str, devices: int) -> None:
    cfg = compose_config([f"strategy={strategy}", f"trainer.devices={devices}"], recipe=recipe, tiny=False)
    validate(cfg)


@pytest.mark.parametrize("group", sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")))
def test_every_group_option_validates_in_the_default_recipe(group: str) -> None:
    for option in sorted((CONF_DIR / group).glob("*.yaml")):
        overrides = [f"{group}={option.stem}"]
        if group == "model":  # the default seq_len may exceed a small model's context
            max_seq_len = OmegaConf.load(option).max_seq_len
            overrides.append(f"data.seq_len={min(256, max_seq_len)}")
        validate(compose_config(overrides, tiny=False))
