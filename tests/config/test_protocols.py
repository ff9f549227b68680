"""Every objective, data module and strategy plugin a config group in conf/ selects satisfies its
protocol (`trainer.protocols.Objective`, `DataModule`; `strategies.plugin.StrategyPlugin`): the
members the Task, the builder and `validate` call exist on the class, so a new group option that
misses one fails here instead of at the first step that calls it. Models: test_model_contract.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from typing_extensions import get_protocol_members

from strategies.mesh import MeshStrategy
from strategies.plugin import StrategyPlugin
from trainer.protocols import DataModule, Objective

CONF = Path(__file__).resolve().parents[2] / "conf"


def _targets(group: str) -> list[tuple[str, str]]:
    """``(option, _target_)`` of each option of ``group`` that names its class itself."""
    found = []
    for option in sorted((CONF / group).glob("*.yaml")):
        target = OmegaConf.load(option).get("_target_")
        if isinstance(target, str):
            found.append((option.stem, target))
    return found


def lacking(cls: type, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``cls`` does not have."""
    return sorted(m for m in get_protocol_members(protocol) if not hasattr(cls, m))


@pytest.mark.parametrize(("group", "protocol"), [("objective", Objective), ("data", DataModule)])
def test_every_option_satisfies_its_protocol(group: str, protocol: type) -> None:
    options = _targets(group)
    assert len(options) >= 5, options  # the group was read
    problems = {
        f"{group}={option}": missing for option, target in options if (missing := lacking(get_class(target), protocol))
    }
    assert problems == {}


def test_every_strategy_plugin_node_is_a_plugin() -> None:
    plugins = 0
    for preset in sorted((CONF / "strategy").glob("*.yaml")):
        node = OmegaConf.load(preset)
        if isinstance(node.get("_target_"), str):
            assert issubclass(get_class(node._target_), MeshStrategy), preset.name
        for key, value in node.items():
            if isinstance(value, DictConfig) and isinstance(value.get("_target_"), str):
                assert issubclass(get_class(value._target_), StrategyPlugin), f"{preset.name}: strategy.{key}"
                plugins += 1
    assert plugins >= 8  # nd.yaml's blocks were read


def test_a_class_missing_a_member_is_found() -> None:
    class NoLoss:
        row_kind = "tokens"

    assert "loss_sum" in lacking(NoLoss, Objective)
