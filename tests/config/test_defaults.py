"""One place for each default: wherever a value is written twice (a YAML preset of the base layer
and the dataclass or signature it configures), the two agree."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class

from strategies.core.parallel_dims import ParallelDims
from strategies.planner.search import SearchSpace
from trainer.compose import CONF_DIR
from trainer.config import PlannerConfig, RunConfig, TrainConfig, TrainerConfig
from trainer.optim import DEFAULT_NO_DECAY


def _yaml(path: Path) -> dict:
    return {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in ("defaults", "hydra")}


def _dataclass_defaults(schema: type) -> dict:
    out = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _disagreements(node: dict, defaults: dict, where: str) -> list[str]:
    return [
        f"{where}.{key}: {value!r} in conf/ but {defaults[key]!r} in code"
        for key, value in node.items()
        if key in defaults
        and not isinstance(value, dict)
        and value != (list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key])  # YAML lists
        and not (isinstance(value, str) and value.startswith("${"))  # follows another key (an alias)
    ]


def test_the_base_layer_agrees_with_the_run_config_dataclasses() -> None:
    base = _yaml(CONF_DIR / "plait_base.yaml")
    problems = _disagreements(base, _dataclass_defaults(RunConfig), "plait_base")
    problems += _disagreements(base["train"], _dataclass_defaults(TrainConfig), "plait_base.train")
    problems += _disagreements(base["planner"], _dataclass_defaults(PlannerConfig), "plait_base.planner")
    problems += _disagreements(
        _yaml(CONF_DIR / "trainer" / "default.yaml"), _dataclass_defaults(TrainerConfig), "trainer/default"
    )
    assert problems == []
    assert set(base["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}  # every field has its base value
    assert tuple(TrainConfig().no_decay) == DEFAULT_NO_DECAY


def test_the_planner_search_space_defaults_are_the_planner_config_ones() -> None:
    planner = _dataclass_defaults(PlannerConfig)
    space = _dataclass_defaults(SearchSpace)
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in space.items()} == {k: planner[k] for k in space}


def _signature_defaults(target: str) -> dict:
    params = inspect.signature(get_class(target)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", ["nd"])
def test_the_strategy_base_agrees_with_mesh_strategy_and_its_plugins(name: str) -> None:
    node = _yaml(CONF_DIR / "strategy" / f"{name}.yaml")
    problems = _disagreements(
        node, _signature_defaults(node["_target_"]) | _dataclass_defaults(ParallelDims), f"strategy/{name}"
    )
    for key, sub in node.items():
        if isinstance(sub, dict) and "_target_" in sub:
            problems += _disagreements(sub, _signature_defaults(sub["_target_"]), f"strategy/{name}.{key}")
    assert problems == []
