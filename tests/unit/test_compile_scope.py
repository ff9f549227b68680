"""strategy.compile.scope: per-block or whole-model compile, and the layouts the model scope refuses."""

from __future__ import annotations

import pytest
import torch
from harness import compose_config

from strategies.compile import Compile, _wait_for_collective, apply_compile
from trainer.config import ConfigError, validate
from trainer.models.llama import Llama


def _model() -> Llama:
    return Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


@pytest.mark.parametrize("scope", ["block", "model"])
def test_the_scope_decides_what_is_compiled_in_place(scope: str) -> None:
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    Compile(enabled=True, backend="eager", scope=scope).apply(model)
    blocks = [b._compiled_call_impl is not None for b in model.layers.children()]
    assert (model._compiled_call_impl is not None) == (scope == "model")
    assert blocks == [scope == "block"] * 2
    assert [n for n, _ in model.named_parameters()] == names  # in place: checkpoints keep their keys


def test_an_unknown_scope_is_refused_by_validate() -> None:
    with pytest.raises(ConfigError, match="strategy.compile.scope"):
        validate(compose_config(["strategy.compile.enabled=true", "strategy.compile.scope=graph"]))


@pytest.mark.parametrize(
    ("layout", "axis"),
    [
        (["strategy=cp", "trainer.devices=2"], "cp=2"),
        (["strategy=pp", "trainer.devices=2"], "pp=2"),
    ],
)
def test_the_model_scope_is_refused_where_it_cannot_run_naming_the_block_scope(layout: list[str], axis: str) -> None:
    overrides = [*layout, "strategy.compile.enabled=true", "strategy.compile.scope=model"]
    with pytest.raises(ConfigError) as error:
        validate(compose_config(overrides))
    assert f"strategy.compile.scope=model does not run with {axis}" in str(error.value)
    assert "use strategy.compile.scope=block" in str(error.value)
    validate(compose_config([*layout, "strategy.compile.enabled=true"]))  # the block scope runs there


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBV", "DualPipeV"])
def test_compiled_blocks_are_refused_under_a_schedule_that_splits_backward(schedule: str) -> None:
    """Each crashed in its first backward ("Failed to run stage backward input"; pytorch/pytorch#161904):
    `python tests/matrix.py --only pp2_ZBV-compile` before the refusal."""
    overrides = ["strategy=pp", "trainer.devices=2", "model.n_layers=4", "train.micro_batch_size=1"]
    overrides.append(f"strategy.pipeline.schedule={schedule}")
    with pytest.raises(ConfigError) as error:
        validate(compose_config([*overrides, "strategy.compile.enabled=true"]))
    assert f"strategy.pipeline.schedule={schedule} splits backward into input and weight passes" in str(error.value)
    assert "use strategy.pipeline.schedule=1F1B, GPipe or Interleaved1F1B, or strategy.compile.enabled=false" in str(
        error.value
    )
    validate(compose_config(overrides))  # the eager schedule runs (tests/dist/test_pipeline.py)


def test_the_model_scope_is_accepted_on_one_process_and_fsdp() -> None:
    for layout in ([], ["strategy=fsdp", "trainer.devices=2"]):
        validate(compose_config([*layout, "strategy.compile.enabled=true", "strategy.compile.scope=model"]))


@pytest.mark.parametrize("scope", ["block", "model"])
def test_compile_with_tensor_parallelism_is_accepted(scope: str) -> None:
    """Trained in tests/dist/test_equivalence.py (tp2_sp_lp_compile_block, tp2_sp_lp_compile_model)."""
    overrides = ["strategy=tp", "trainer.devices=2", "strategy.compile.enabled=true", f"strategy.compile.scope={scope}"]
    validate(compose_config(overrides))


def test_modules_outside_the_blocks_hand_on_plain_tensors() -> None:
    """The block scope hooks the modules around the blocks: an AsyncCollectiveTensor output (a TP
    module's reduction in flight) comes out as a plain tensor with the same values."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # noqa: PLC0415 - the case

    model = _model()
    apply_compile(model, backend="eager", scope="block")
    x = torch.randn(2, 3)
    pending = AsyncCollectiveTensor(x * 2)
    assert _wait_for_collective in model.tok_embeddings._forward_hooks.values()
    assert _wait_for_collective not in model.layers["0"]._forward_hooks.values()
    out = _wait_for_collective(model.tok_embeddings, (), pending)
    assert type(out) is torch.Tensor and torch.equal(out, x * 2)  # the gradient: tests/dist/test_equivalence.py
    assert _wait_for_collective(model.tok_embeddings, (), x) is x


def test_the_whole_model_compiles_as_one_graph_without_document_ids() -> None:
    """fullgraph=True with the model scope: without document ids nothing breaks the graph (the
    document layout is built outside the compiled region only when there are ids)."""
    torch._dynamo.reset()
    model = _model()
    apply_compile(model, backend="eager", fullgraph=True, scope="model")
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    torch._dynamo.reset()


def test_the_model_scope_without_compile_on_is_refused_naming_the_switch() -> None:
    """strategy.compile.scope=model alone compiled nothing, without a word (compile is off by default)."""
    with pytest.raises(ConfigError, match="add strategy.compile.enabled=true"):
        validate(compose_config(["strategy.compile.scope=model"]))
    validate(compose_config(["strategy.compile.scope=block"]))  # the default scope, off: nothing to say
