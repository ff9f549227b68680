"""strategy.compile.scope: per-block or whole-model compile, and the layouts the model scope refuses."""

from __future__ import annotations

import pytest
from harness import compose_config

from strategies.compile import Compile
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


def test_the_model_scope_is_accepted_on_one_process_and_fsdp() -> None:
    for layout in ([], ["strategy=fsdp", "trainer.devices=2"]):
        validate(compose_config([*layout, "strategy.compile.enabled=true", "strategy.compile.scope=model"]))


@pytest.mark.parametrize("scope", ["block", "model"])
def test_compile_with_tensor_parallelism_is_refused_naming_the_fix(scope: str) -> None:
    """Compiled tensor-parallel blocks fail their first backward (torch 2.13, CPU): refused at validate."""
    overrides = ["strategy=tp", "trainer.devices=2", "strategy.compile.enabled=true", f"strategy.compile.scope={scope}"]
    with pytest.raises(ConfigError, match=r"does not train with tp=2.*use strategy.compile.enabled=false"):
        validate(compose_config(overrides))
