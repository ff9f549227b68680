"""ParallelDims: -1 fills the world, every layout problem is reported with its fix (case C18's rule)."""

from __future__ import annotations

import pytest

from strategies.core.parallel_dims import LayoutError, ParallelDims, divisors


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


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
