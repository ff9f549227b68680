"""validate(cfg): every problem at once, each naming the override that fixes it; nothing mutated."""

from __future__ import annotations

import pytest
from harness import compose_config
from omegaconf import OmegaConf

from trainer.config import ConfigError, validate


def _problems(overrides: list[str]) -> list[str]:
    cfg = compose_config(overrides)
    before = OmegaConf.to_yaml(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert OmegaConf.to_yaml(cfg) == before
    return err.value.problems


def test_valid_tiny_config_passes() -> None:
    validate(compose_config())


def test_unknown_keys_suggest_the_close_name() -> None:
    problems = _problems(["+train.micro_batch=3", "+model.n_head=4"])
    assert any("unknown key train.micro_batch (did you mean micro_batch_size?)" in p for p in problems)
    assert any("unknown key model.n_head (did you mean n_heads?)" in p for p in problems)


def test_types_are_checked_for_schema_and_targets() -> None:
    problems = _problems(["trainer.max_steps=abc", "model.dim=wide", "optim.lr=fast"])
    assert any(p.startswith("trainer.max_steps='abc' must be int") for p in problems)
    assert any(p.startswith("model.dim='wide' must be int") for p in problems)
    assert len(problems) == 3


def test_logger_arguments_are_type_checked_though_one_annotation_does_not_resolve() -> None:
    # WandbLogger's ``experiment: "Run"`` made typing.get_type_hints fail, and with it every check
    # of logger.wandb.*: a numeric name or id reached wandb after launch.
    problems = _problems(["logger=wandb", "logger.wandb.name=123", "+logger.wandb.id=7"])
    assert "logger.wandb.name=123 must be str or null" in problems
    assert "logger.wandb.id=7 must be str or null" in problems


@pytest.mark.parametrize("value, shown", [("[1,2]", "[1, 2]"), ("[[a]]", "[['a']]"), ("{a:1}", "{'a': 1}")])
def test_a_list_or_mapping_of_the_wrong_type_is_refused(value: str, shown: str) -> None:
    # Before: lists and mappings were never type-checked; data.path=[1,2] reached os.path.expanduser
    # after launch (TypeError: expected str ... not int).
    assert f"data.path={shown} must be str or a list of str or null" in _problems([f"data.path={value}"])


def test_semantic_problems_are_all_reported() -> None:
    problems = _problems(["train.global_batch_size=7", "data.seq_len=4096", "trainer.devices=2", "strategy.tp=3"])
    text = "\n".join(problems)
    assert "strategy.tp=3" not in text or "world size" in text
    assert "the degrees" in text or "does not divide the world size" in text


def test_batch_and_length_problems() -> None:
    problems = _problems(["train.global_batch_size=7", "data.seq_len=4096"])
    assert any("train.global_batch_size=7 must be a multiple of train.micro_batch_size=4" in p for p in problems)
    assert any("data.seq_len=4096 exceeds model.max_seq_len=256" in p for p in problems)


def test_missing_paths_name_the_fix() -> None:
    problems = _problems(["data.path=/nonexistent/corpus.jsonl", "data.tokenizer=/nonexistent/tokenizer.json"])
    assert any("data.path=/nonexistent/corpus.jsonl does not exist" in p for p in problems)
    assert any("data.tokenizer=/nonexistent/tokenizer.json is not a file" in p for p in problems)


def test_bad_target_is_reported() -> None:
    problems = _problems(["optim._target_=torch.optim.NoSuchOptimizer"])
    assert any("optim._target_=torch.optim.NoSuchOptimizer cannot be imported" in p for p in problems)


@pytest.mark.parametrize("recipe", ["pretrain", "sft", "dpo"])
def test_the_data_keys_every_data_module_passes_to_its_base_are_checked(recipe: str) -> None:
    """The common data.* keys (``**settings: Unpack[Settings]``) are checked like the module's own."""
    cfg = compose_config(["data.seq_len=long", "+data.vocab_sise=5"], recipe=recipe, tiny=False)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    problems = err.value.problems
    assert any(p.startswith("data.seq_len='long' must be int") for p in problems)
    assert any("unknown key data.vocab_sise (did you mean vocab_size?)" in p for p in problems)


def test_a_data_group_of_another_recipe_is_refused_not_a_traceback() -> None:
    """``plait sft data=stream``: sft's objective reads ``${oc.dict.keys:data.sources}``, which
    the stream group lacks (an InterpolationResolutionError from validate before)."""
    cfg = compose_config(["data=stream", "data.path=x"], recipe="sft")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.problems == [
        "objective.groups=${oc.dict.keys:data.sources} does not resolve (Key not found: 'data.sources'): "
        "a group of another recipe? `plait <recipe> --help` lists each group's choices"
    ]
