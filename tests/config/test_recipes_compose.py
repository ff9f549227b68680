"""Every bundled recipe composes and validates with every strategy preset, at 1 and 2 processes."""

from __future__ import annotations

import copy
import functools
import math

import pytest
from harness import compose_config
from omegaconf import DictConfig, OmegaConf

from trainer.compose import CONF_DIR, bundled_recipes
from trainer.config import ConfigError, validate

STRATEGIES = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))
# preference composes exactly as its alias dpo (but for the recipe name), so the aliases stand for it.
RECIPES = sorted(set(bundled_recipes()) - {"preference"})


def test_there_is_something_to_compose() -> None:
    assert "pretrain" in RECIPES and {"ddp", "fsdp", "hsdp", "nd"} <= set(STRATEGIES)


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_x_strategy_validates(recipe: str, strategy: str, devices: int) -> None:
    cfg = copy.deepcopy(_composed(recipe, strategy))
    cfg.trainer.devices = devices
    fixed = math.prod(d for axis in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if (d := cfg.strategy[axis]) != -1)
    if devices % fixed:  # a preset with fixed degrees (hsdp: dp_shard=2) needs a multiple of them
        with pytest.raises(ConfigError, match="trainer.devices"):
            validate(cfg)
    elif cfg.strategy.fault_tolerance is not None and cfg.objective._target_.rsplit(".", 2)[-2] in (
        "preference",
        "kto",
    ):
        with pytest.raises(ConfigError, match="train the preference recipes without strategy.fault_tolerance"):
            validate(cfg)  # replica groups: their reference log-probs and KL estimate stay within a group
    elif cfg.strategy.local_sgd is not None and cfg.strategy.fault_tolerance is None and devices // fixed < 2:
        # local SGD needs 2 islands or more (across replica groups, the groups are the islands)
        with pytest.raises(ConfigError, match="needs at least 2 islands"):
            validate(cfg)
    elif recipe == "rest" and cfg.strategy.fault_tolerance is not None:
        with pytest.raises(ConfigError, match="plait rest fits its runs in processes of its own"):
            validate(cfg)  # its rounds are fitted in children of the driver, not as replica groups
    elif recipe == "rest" and cfg.strategy.local_sgd is not None and strategy != "ist":
        with pytest.raises(ConfigError, match="plait rest takes its runs' models from their checkpoints"):
            validate(cfg)  # each round's model is its last checkpoint: one model, not the islands' own
    elif recipe == "paft" and strategy == "ist":
        with pytest.raises(ConfigError, match="callbacks.delta_l1 pulls every weight"):
            validate(cfg)  # the SFT arm's step-0 copy is full width, IST's MLPs narrower
    elif cfg.model.n_heads % _resolved(cfg, devices, "tp") or cfg.model.n_kv_heads % _resolved(cfg, devices, "tp"):
        with pytest.raises(ConfigError, match="valid tp: "):  # the tiny model's 6 heads / 2 kv heads: tp <= 2
            validate(cfg)
    elif (
        cfg.objective._target_.rsplit(".", 2)[-2] in ("preference", "kto")
        and max(_resolved(cfg, devices, "cp"), _resolved(cfg, devices, "pp")) > 1
    ):
        with pytest.raises(ConfigError, match="does not support strategy"):  # pairs are not split by cp or pp
            validate(cfg)
    elif recipe == "grpo" and (
        cfg.strategy.local_sgd is not None or max(_resolved(cfg, devices, a) for a in ("cp", "pp", "tp")) > 1
    ):
        with pytest.raises(ConfigError, match="objective GRPO"):  # rollouts need whole sequences, no islands
            validate(cfg)
    else:
        validate(cfg)


@functools.cache
def _composed(recipe: str, strategy: str) -> DictConfig:
    """Composed once for the three device counts (composing took most of the test's time; validating is its subject)."""
    return compose_config([f"strategy={strategy}"], recipe=recipe, tiny=False)


def _resolved(cfg, devices: int, axis: str) -> int:
    from strategies.core.parallel_dims import MESH_AXES, ParallelDims

    return getattr(ParallelDims(**{a: cfg.strategy[a] for a in MESH_AXES}).resolve(devices), axis)


def test_every_preset_starts_with_a_comment_and_extends_nd() -> None:
    # nd.yaml holds every plugin block once; the other presets only change degrees and knobs.
    base = OmegaConf.load(CONF_DIR / "strategy" / "nd.yaml")
    assert {"fsdp", "activation_checkpoint", "compile"} <= set(base)
    for preset in sorted((CONF_DIR / "strategy").glob("*.yaml")):
        assert preset.read_text().startswith("# "), preset.name
        if preset.stem != "nd":
            assert OmegaConf.load(preset).defaults == ["nd", "_self_"], preset.name
            composed = compose_config([f"strategy={preset.stem}"], tiny=False).strategy
            assert set(base) <= set(composed), preset.name


@pytest.mark.parametrize(
    "group", sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))
)
def test_every_group_option_validates_in_the_default_recipe(group: str) -> None:
    for option in sorted((CONF_DIR / group).glob("*.yaml")):
        overrides = [f"{group}={option.stem}"]
        if group == "model" and OmegaConf.is_missing(OmegaConf.load(option), "init_from"):
            continue  # model=hf needs a checkpoint directory: tests/unit/test_hf.py validates it
        if group == "model":  # the default seq_len may exceed a small model's context
            max_seq_len = OmegaConf.load(option).max_seq_len
            overrides.append(f"data.seq_len={min(256, max_seq_len)}")
        if (group, option.stem) == ("data", "stream"):  # a streamed table has no default path
            overrides.append(f"data.path={CONF_DIR}")  # any existing folder
        if group == "strategy":  # hsdp fixes dp_shard=2: a world of 4 fits every preset
            # ... except tp, which puts every rank on tp: the tiny model's 2 kv heads allow 2.
            overrides.append("trainer.devices=2" if option.stem == "tp" else "trainer.devices=4")
        # A budget search and the per-source SFT objective need the SFT recipe's named sources.
        recipe = "sft" if group == "budget" or (group, option.stem) == ("objective", "sft") else "pretrain"
        if group == "data" and option.stem.startswith("preference"):  # pairs: an objective that trains on them
            recipe = "dpo"
        if group == "paft" or (group == "objective" and option.stem in ("dpo", "ipo", "simpo", "orpo", "kto")):
            # PAFT arms; preference objectives need pairs (KTO: unpaired rows, its alias sets them)
            recipe = "paft" if group == "paft" else ("kto" if option.stem == "kto" else "dpo")
        if (group, option.stem) in (("data", "prompts"), ("data", "countdown")) or (
            group == "objective" and option.stem in ("grpo", "dr_grpo", "dapo", "gspo", "rloo")
        ):  # prompts and the online objectives that sample their rows
            recipe = "grpo"
        if (group, option.stem) == ("data", "rest"):  # a ReST round's traces: the rounds write its sources
            recipe = "rest"
        validate(compose_config(overrides, recipe=recipe, tiny=False))
