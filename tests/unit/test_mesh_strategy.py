"""MeshStrategy refuses degrees on axes it does not parallelize, before any process starts."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.activation_checkpoint import ActivationCheckpoint
from strategies.compile import Compile
from strategies.mesh import MeshStrategy
from strategies.parallel_dims import LayoutError
from trainer.config import ConfigError, validate


def test_unapplied_axes_are_refused_with_the_fix() -> None:
    class DataParallelOnly(MeshStrategy):
        supported_axes = ("dp_replicate", "dp_shard")

    message = "strategy.cp=2: DataParallelOnly does not apply cp parallelism yet; use strategy.cp=1"
    with pytest.raises(LayoutError, match=message):
        DataParallelOnly(dp_shard=1, cp=2)
    DataParallelOnly(dp_replicate=2, dp_shard=-1)  # the data-parallel axes are applied
    assert MeshStrategy(dp_shard=1, cp=2).dims.cp == 2  # context parallelism is applied (strategies.context)


def test_a_subclass_that_applies_an_axis_may_use_it() -> None:
    class WithTP(MeshStrategy):
        supported_axes = (*MeshStrategy.supported_axes, "tp")

    assert WithTP(dp_shard=-1, tp=2).dims.tp == 2


def test_validate_accepts_the_pipeline_axis() -> None:
    # Pipeline parallelism is applied (strategies.pipeline); the refusal of an unapplied axis is
    # tested above with a subclass that applies fewer axes.
    validate(compose_config(["strategy=nd", "strategy.pp=2", "trainer.devices=2"]))


def test_plugins_default_to_off() -> None:
    strategy = MeshStrategy()
    assert strategy.activation_checkpoint == ActivationCheckpoint(mode="none")
    assert strategy.compile_plugin == Compile(enabled=False)


def test_validate_checks_every_plugin_node_before_launch() -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["strategy.activation_checkpoint.mode=partial", "strategy.compile.enabled=maybe"]))
    assert err.value.problems == [
        "strategy.activation_checkpoint.mode='partial' must be one of none, full, every_k, selective",
        "strategy.compile.enabled='maybe' must be bool",
    ]


def test_an_unknown_cpu_allocator_is_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["strategy.cpu_allocator=jemalloc"]))
    assert err.value.problems == ["strategy.cpu_allocator='jemalloc' must be one of keep_freed, system"]
    with pytest.raises(ValueError, match="strategy.cpu_allocator='jemalloc' is unknown; use keep_freed or system"):
        MeshStrategy(cpu_allocator="jemalloc")  # a strategy built by hand, without validate
