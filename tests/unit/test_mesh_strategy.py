"""MeshStrategy refuses degrees on axes it does not parallelize, before any process starts."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.activation_checkpoint import ActivationCheckpoint
from strategies.compile import Compile
from strategies.core.parallel_dims import LayoutError, ParallelDims
from strategies.mesh import MeshStrategy, build_strategy
from trainer.config import ConfigError, validate


def test_unapplied_axes_are_refused_with_the_fix() -> None:
    class DataParallelOnly(MeshStrategy):
        supported_axes = ("dp_replicate", "dp_shard")

    message = "strategy.cp=2: DataParallelOnly does not apply cp parallelism yet; use strategy.cp=1"
    with pytest.raises(LayoutError, match=message):
        DataParallelOnly(ParallelDims(dp_shard=1, cp=2))
    DataParallelOnly(ParallelDims(dp_replicate=2, dp_shard=-1))  # the data-parallel axes are applied
    assert (
        MeshStrategy(ParallelDims(dp_shard=1, cp=2)).dims.cp == 2
    )  # context parallelism is applied (strategies.context.plugin)


def test_a_subclass_that_applies_an_axis_may_use_it() -> None:
    class WithTP(MeshStrategy):
        supported_axes = (*MeshStrategy.supported_axes, "tp")

    assert WithTP(ParallelDims(dp_shard=-1, tp=2)).dims.tp == 2


def test_validate_accepts_the_pipeline_axis() -> None:
    # Pipeline parallelism is applied (strategies.pipeline.plugin); the refusal of an unapplied axis is
    # tested above with a subclass that applies fewer axes.
    validate(compose_config(["strategy=nd", "strategy.pp=2", "trainer.devices=2"]))


def test_plugins_default_to_off() -> None:
    strategy = MeshStrategy()
    assert strategy.plugins["activation_checkpoint"] == ActivationCheckpoint(mode="none")
    assert strategy.plugins["compile"] == Compile(enabled=False)


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


def test_a_mode_key_that_moved_into_its_plugin_is_refused_naming_the_new_key() -> None:
    with pytest.raises(ConfigError) as err:
        validate(
            compose_config(
                ["strategy=cp", "trainer.devices=2", "+strategy.cp_mode=ulysses", "+strategy.pp_schedule=ZBV"]
            )
        )
    assert err.value.problems == [
        "strategy.cp_mode is now strategy.context_parallel.mode; use strategy.context_parallel.mode=ulysses",
        "strategy.pp_schedule is now strategy.pipeline.schedule; use strategy.pipeline.schedule=ZBV",
    ]
    run = validate(compose_config(["strategy=cp", "trainer.devices=2", "strategy.context_parallel.mode=ulysses"]))
    assert run.dims.cp == 2


def test_the_strategy_node_is_split_into_degrees_plugins_and_settings() -> None:
    strategy = build_strategy(
        compose_config(
            ["strategy=pp", "strategy.pipeline.schedule=GPipe", "strategy.timeout_s=30", "strategy.heartbeat_s=0"]
        ).strategy
    )
    assert (strategy.dims.pp, strategy.dims.dp_shard, strategy.heartbeat) == (-1, 1, None)
    assert strategy.plugins["pipeline"].schedule == "GPipe" and "lora" not in strategy.plugins
    with pytest.raises(ValueError, match="strategy.tag='x' is neither a plugin node"):
        build_strategy(compose_config(["+strategy.tag=x"]).strategy)


def test_a_plugin_written_for_the_two_argument_reduce_gradients_still_runs() -> None:
    """`StrategyPlugin.reduce_gradients` took (parameters, loss) before the step's named sums travelled
    with it; a user's plugin written then is called that way (a reviewer: a TypeError at its first step).
    Mutation: always passing ``sums`` -> TypeError."""
    import torch

    from strategies.plugin import StrategyPlugin

    class Old(StrategyPlugin):
        def reduce_gradients(self, parameters, loss):  # the signature plugin.py documented before
            return loss * 2, True

    class Passing(StrategyPlugin):  # a wrapper that passes what it gets on, or names the third its own way
        def reduce_gradients(self, parameters, loss, *rest):
            return loss + len(rest[0]), True

    strategy = MeshStrategy()
    for plugin, expected in ((Old(), 3.0), (Passing(), 2.5)):
        strategy.active = (plugin,)
        loss, commit = strategy.reduce_gradients([], torch.tensor(1.5), [torch.zeros(2, 1)])
        assert loss.item() == expected and commit
