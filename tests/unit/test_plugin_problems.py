"""Every plugin reports its own problems for a resolved run and the model's shape (the plugin
contract, `strategies.plugin.StrategyPlugin`: ``problems(run, shape)``), validate walks them before
any process starts, and the strategy walks its plugins in one documented ORDER."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.context.plugin import ContextParallel
from strategies.core.parallel_dims import ParallelDims
from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.float8 import Float8
from strategies.local_sgd import DiLoCo
from strategies.mesh import MeshStrategy
from strategies.pipeline.plugin import PipelineParallel
from strategies.plugin import StrategyPlugin
from strategies.transforms.lora import LoRA
from trainer.config import ConfigError, validate


def _run(dims: ParallelDims, **fields) -> ResolvedRun:
    return ResolvedRun(
        world_size=dims.world_size, dims=dims, global_batch_size=8, micro_batch_size=1, num_micro_batches=8, **fields
    )


def test_the_context_parallel_rule_is_the_plugins_own() -> None:
    # Load-balanced shards cut the sequence into 2 cp chunks; contiguous ones into cp (shard_positions).
    validate(
        compose_config(
            ["strategy=cp", "trainer.devices=2", "data.seq_len=66", "strategy.context_parallel.load_balance=false"]
        )
    )
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["strategy=cp", "trainer.devices=2", "data.seq_len=66"]))
    assert err.value.problems == [
        "data.seq_len=66 is not divisible by 2*cp=4 (load-balanced ring attention); use a seq_len that is a multiple of 4"
    ]
    contiguous = ContextParallel(load_balance=False).problems(_run(ParallelDims(dp_shard=1, cp=2), seq_len=65), None)
    assert contiguous == ["data.seq_len=65 is not divisible by cp=2; use a seq_len that is a multiple of 2"]


def test_pipeline_problems_use_the_model_shape() -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["strategy=pp", "strategy.pp=4", "trainer.devices=4", "train.micro_batch_size=1"]))
    assert (
        "strategy.pp=4 stages need at least as many blocks, but the model has 2; use strategy.pp<=2"
        in err.value.problems
    )
    assert PipelineParallel().problems(_run(ParallelDims(dp_shard=1)), None) == []  # pp = 1: nothing to check


def test_every_plugin_implements_the_contract_and_the_walk_follows_the_documented_order() -> None:
    strategy = MeshStrategy(plugins={"local_sgd": None})
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=2, pp=2)
    names = [type(p).__name__ for p in strategy.active_plugins(dims)]
    assert names == [
        "PipelineParallel", "TensorParallel", "ContextParallel", "ExpertParallel", "ActivationOffload",
        "ActivationCheckpoint", "Compile", "FSDP",
    ]  # fmt: skip
    assert all(isinstance(p, StrategyPlugin) for p in strategy.plugins.values())
    # One rank per axis: the always-on plugins only (each is a no-op when off).
    assert [type(p).__name__ for p in strategy.active_plugins(ParallelDims(dp_shard=1))] == [
        "ExpertParallel", "ActivationOffload", "ActivationCheckpoint", "Compile",
    ]  # fmt: skip


def test_plugins_given_in_any_order_are_walked_in_order_and_islands_keep_fsdp_inside_one() -> None:
    strategy = MeshStrategy(plugins={"local_sgd": DiLoCo(sync_every=2), "lora": LoRA()})
    assert list(strategy.plugins) == [
        "float8", "pipeline", "tensor_parallel", "context_parallel", "expert_parallel", "lora", "activation_offload",
        "activation_checkpoint", "compile", "fsdp", "local_sgd",
    ]  # fmt: skip
    # Two islands of one rank each: no FSDP (the islands do not share gradients), local SGD last.
    active = [type(p).__name__ for p in strategy.active_plugins(ParallelDims(dp_replicate=2, dp_shard=1))]
    assert active[-2:] == ["Compile", "DiLoCo"] and strategy.token_axis == "dp_shard"
    assert not strategy.plugins["fsdp"].active(ParallelDims(dp_replicate=2, dp_shard=1), islands=True)
    assert strategy.plugins["fsdp"].active(ParallelDims(dp_replicate=2, dp_shard=1), islands=False)
    # A declared conflict is reported with both keys.
    run = _run(ParallelDims(dp_replicate=2, dp_shard=1))
    assert (
        "strategy.lora does not compose with strategy.local_sgd yet; use strategy.local_sgd=null"
        in strategy.problems(run, None)
    )


def test_validate_returns_the_resolved_run_with_the_model_shape() -> None:
    run = validate(compose_config(["strategy=fsdp_tp", "trainer.devices=4"]))
    assert (run.world_size, run.dims.dp_shard, run.dims.tp) == (4, 2, 2)
    assert isinstance(run.shape, ModelShape) and (run.shape.n_layers, run.shape.vocab_size) == (2, 4096)
    assert (run.global_batch_size, run.micro_batch_size, run.num_micro_batches) == (8, 4, 1)


def test_a_plugin_that_reads_the_final_weights_steps_after_the_others() -> None:
    """float8's scale precompute (after_others) runs after local SGD has averaged the weights."""
    calls: list[str] = []

    class Reader(StrategyPlugin):
        after_others = True

        def after_step(self, model, step, optimizer):  # noqa: ANN001, ANN201
            calls.append("reader")
            return {"read": step}

    class Writer(StrategyPlugin):
        def after_step(self, model, step, optimizer):  # noqa: ANN001, ANN201
            calls.append("writer")
            return {"written": step}

    strategy = MeshStrategy(plugins={"a_reader": Reader(), "b_writer": Writer()})
    strategy.active = [strategy.plugins["a_reader"], strategy.plugins["b_writer"]]
    assert strategy.after_optimizer_step(None, 3, None) == {"read": 3, "written": 3}
    assert calls == ["writer", "reader"]
    assert Float8.after_others
