"""ParallelDims: -1 fills the world, every layout problem is reported with its fix (case C18's rule)."""

from __future__ import annotations

import pytest

from strategies.parallel_dims import LayoutError, ParallelDims, divisors


def test_fill_from_world_size() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2).resolve(8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp, dims.world_size) == (2, 2, 2, 4, 8)


def test_product_must_match_world_size() -> None:
    with pytest.raises(LayoutError, match="multiply to 4 but the world size is 2"):
        ParallelDims(dp_shard=2, tp=2).resolve(2)


def test_fixed_degrees_must_divide_world() -> None:
    with pytest.raises(LayoutError, match="does not divide the world size 6"):
        ParallelDims(dp_shard=-1, tp=4).resolve(6)


def test_all_value_problems_reported_at_once() -> None:
    with pytest.raises(LayoutError) as err:
        ParallelDims(dp_shard=-1, cp=0, tp=-1, pp=-3).resolve(4)
    message = str(err.value)
    assert "strategy.cp=0" in message and "strategy.pp=-3" in message and "only one degree may be -1" in message


@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "tp", "valid"),
    [(32, 2, 4, "valid tp: 1, 2"), (28, 28, 8, "valid tp: 1, 2, 4, 7, 14, 28")],
)
def test_tp_must_divide_heads_and_lists_valid_degrees(n_heads: int, n_kv_heads: int, tp: int, valid: str) -> None:
    dims = ParallelDims(dp_shard=1, tp=tp).resolve(tp)
    problems = dims.check_model(n_layers=4, n_heads=n_heads, n_kv_heads=n_kv_heads, seq_len=64)
    assert len(problems) == 1 and valid in problems[0]


def test_pp_and_cp_model_checks() -> None:
    dims = ParallelDims(dp_shard=1, pp=4, cp=2).resolve(8)
    problems = dims.check_model(n_layers=2, n_heads=4, n_kv_heads=4, seq_len=66)
    assert any("pp=4 exceeds the 2 layers" in p for p in problems)
    assert any("not divisible by 2*cp=4" in p for p in problems)
    assert ParallelDims(dp_shard=1, pp=2, cp=2).resolve(4).check_model(n_layers=2, n_heads=4, n_kv_heads=4, seq_len=64) == []


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
