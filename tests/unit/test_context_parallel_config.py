"""Context-parallel layouts are checked before launch, naming the fix (valid Ulysses degrees)."""

import pytest
from harness import compose_config

from strategies.context.plugin import context_parallel_problems
from trainer.config import ConfigError, validate


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(list(overrides)))
    return str(err.value)


def test_ulysses_degree_must_split_the_heads_evenly():
    # nano: 4 query heads, 2 kv heads; Ulysses over 4 ranks would need 4 kv heads.
    message = _problems("strategy=cp", "strategy.context_parallel.mode=ulysses", "trainer.devices=4")
    assert "strategy.cp=4" in message and "valid Ulysses degrees: 1, 2" in message


def test_hybrid_degree_must_lie_inside_cp():
    message = _problems("strategy=cp", "strategy.context_parallel.mode=hybrid", "trainer.devices=2")
    assert "ulysses_degree=2 must divide cp=2 and lie strictly between 1 and cp" in message


def test_bad_mode_is_reported_once():
    message = _problems("strategy=cp", "strategy.context_parallel.mode=zigzag", "trainer.devices=2")
    assert message.count("context_parallel.mode") == 1 and "ring, ulysses, hybrid" in message


def test_valid_layouts_pass():
    for overrides in (
        ["strategy=cp", "trainer.devices=4"],
        ["strategy=cp", "strategy.context_parallel.mode=ulysses", "trainer.devices=2"],
        ["strategy=cp", "strategy.context_parallel.mode=hybrid", "trainer.devices=4"],
        ["strategy=nd", "strategy.cp=2", "strategy.dp_shard=2", "trainer.devices=4"],
    ):
        validate(compose_config(overrides))


def test_tensor_parallel_heads_count_per_rank():
    # tp=2 leaves 16 query and 4 kv heads per rank: Ulysses 8 does not split 4 kv heads.
    problems = context_parallel_problems(mode="hybrid", cp=16, tp=2, ulysses_degree=8, n_heads=32, n_kv_heads=8)
    assert len(problems) == 1 and "valid Ulysses degrees: 2, 4" in problems[0]
    assert context_parallel_problems(mode="hybrid", cp=16, tp=2, ulysses_degree=4, n_heads=32, n_kv_heads=8) == []


def test_chunked_loss_and_loss_parallel_exclude_each_other():
    message = _problems("strategy=tp", "trainer.devices=2", "objective.loss_chunk_tokens=64")
    assert "objective.loss_chunk_tokens=64 needs tp=1" in message
