"""Hybrid cp placement (strategies/cp_placement.py): which rows train whole, on which cp rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from strategies.cp_placement import WHOLE_ROWS, micro_batches_of, place_whole_rows, plan_placement, short_rows
from strategies.document_runs import causal_pairs, longest_document  # fmt: skip


def _rows(*lengths_per_row: list[int]) -> torch.Tensor:
    """``[B, T]`` document ids from each row's document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row])


def test_longest_document_and_pairs():
    docs = _rows([3, 5], [8], [1, 1, 6])
    assert longest_document(docs).tolist() == [5, 8, 6]
    assert causal_pairs(docs).tolist() == [6 + 15, 36, 1 + 1 + 21]
    assert short_rows(docs, 2).tolist() == [False, False, False]  # 4 tokens per shard
    assert short_rows(_rows([2, 2, 4], [4, 4], [5, 3]), 2).tolist() == [True, True, False]


def test_whole_rows_equal_count_and_balanced():
    work = torch.tensor([9.0, 1.0, 8.0, 2.0, 5.0, 5.0])
    placed = place_whole_rows(work, 2)
    assert sorted(itertools.chain(*placed)) == list(range(6))
    assert [len(p) for p in placed] == [3, 3]
    loads = [float(work[p].sum()) for p in placed]
    assert max(loads) - min(loads) <= 1.0  # {9, 2, 5} / {8, 1, 5}: 16 vs 14 would be worse
    best = min(
        abs(float(work[list(c)].sum()) * 2 - float(work.sum())) for c in itertools.combinations(range(6), 3)
    )
    assert abs(loads[0] - loads[1]) <= best + 2.0


def test_plan_places_lightest_short_rows_and_splits_the_rest():
    docs = _rows([2, 2, 4], [8], [4, 4], [1, 1, 1, 1, 1, 1, 1, 1], [3, 5], [4, 2, 2])  # T = 8, cp = 2: short <= 4
    placed = plan_placement(docs, 2, count=2)
    whole = torch.cat(placed.whole)
    assert sorted(whole.tolist() + placed.split.tolist()) == list(range(6))
    assert [len(w) for w in placed.whole] == [1, 1]
    # the short rows of least causal work: row 3 (8 pairs), then rows 0 and 5 (16 each: the lower index)
    assert set(whole.tolist()) == {0, 3}
    assert placed.split.tolist() == [1, 2, 4, 5]
    none = plan_placement(docs, 2, count=0)
    assert none.split.tolist() == list(range(6)) and all(len(w) == 0 for w in none.whole)


def test_micro_batches_are_marked():
    batch = {"input_ids": torch.zeros(5, 4, dtype=torch.long), "labels": torch.ones(5, 4, dtype=torch.long)}
    mbs = micro_batches_of(batch, 2, whole=True)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [2, 2, 1] and all(WHOLE_ROWS in mb for mb in mbs)
    assert all(WHOLE_ROWS not in mb for mb in micro_batches_of(batch, 2))


def test_validate_refuses_hybrid_placement_that_cannot_apply():
    from harness import compose_config

    from trainer.config import ConfigError, validate

    key = "strategy.context_parallel.placement"
    validate(compose_config([f"{key}=hybrid", "strategy=cp", "trainer.devices=2", "train.micro_batch_size=2"]))
    with pytest.raises(ConfigError, match="strategy.cp=1; set strategy.cp > 1 or placement=split"):
        validate(compose_config([f"{key}=hybrid"]))
    with pytest.raises(ConfigError, match="train.micro_batch_size=1 < cp=2"):
        validate(compose_config([f"{key}=hybrid", "strategy=cp", "trainer.devices=2", "train.micro_batch_size=1"]))
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        validate(compose_config([f"{key}=hybrid", "strategy=nd", "strategy.cp=2", "strategy.pp=2", "strategy.dp_shard=1",
                                 "trainer.devices=4", "train.micro_batch_size=2"]))  # fmt: skip
    with pytest.raises(ConfigError, match="'spread' is unknown; use one of split, hybrid"):
        validate(compose_config([f"{key}=spread", "strategy=cp", "trainer.devices=2"]))
