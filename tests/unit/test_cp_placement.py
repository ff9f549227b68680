"""Hybrid cp placement (strategies/context/placement.py): which rows train on which cp group, on which ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from strategies.context.placement import (
    CP_GROUP,
    fit_sizes,
    group_sizes,
    micro_batches_of,
    place_rows,
    placement_problems,
    plan_placement,
    row_counts,
)
from strategies.core.document_runs import causal_pairs, longest_document


def _rows(*lengths_per_row: list[int]) -> torch.Tensor:
    """``[B, T]`` document ids from each row's document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row])


def test_longest_document_and_pairs():
    docs = _rows([3, 5], [8], [1, 1, 6])
    assert longest_document(docs).tolist() == [5, 8, 6]
    assert causal_pairs(docs).tolist() == [6 + 15, 36, 1 + 1 + 21]
    assert fit_sizes(docs, 2, (1,)).tolist() == [2, 2, 2]  # 4 tokens per shard
    assert fit_sizes(_rows([2, 2, 4], [4, 4], [5, 3]), 2, (1,)).tolist() == [1, 1, 2]


def test_whole_rows_equal_count_and_balanced():
    work = torch.tensor([9.0, 1.0, 8.0, 2.0, 5.0, 5.0])
    placed = place_rows(work, 2)
    assert sorted(itertools.chain(*placed)) == list(range(6))
    assert [len(p) for p in placed] == [3, 3]
    loads = [float(work[p].sum()) for p in placed]
    assert max(loads) - min(loads) <= 1.0  # {9, 2, 5} / {8, 1, 5}: 16 vs 14 would be worse
    best = min(abs(float(work[list(c)].sum()) * 2 - float(work.sum())) for c in itertools.combinations(range(6), 3))
    assert abs(loads[0] - loads[1]) <= best + 2.0


def test_plan_places_lightest_short_rows_and_splits_the_rest():
    docs = _rows([2, 2, 4], [8], [4, 4], [1, 1, 1, 1, 1, 1, 1, 1], [3, 5], [4, 2, 2])  # T = 8, cp = 2: short <= 4
    placed = plan_placement(docs, 2, {1: 2})
    whole = torch.cat(placed.groups[1])
    assert sorted(whole.tolist() + placed.split.tolist()) == list(range(6))
    assert [len(w) for w in placed.groups[1]] == [1, 1]
    # the short rows of least causal work: row 3 (8 pairs), then rows 0 and 5 (16 each: the lower index)
    assert set(whole.tolist()) == {0, 3}
    assert placed.split.tolist() == [1, 2, 4, 5]
    none = plan_placement(docs, 2, {1: 0})
    assert none.split.tolist() == list(range(6)) and not none.groups


def test_micro_batches_are_marked():
    batch = {"input_ids": torch.zeros(5, 4, dtype=torch.long), "labels": torch.ones(5, 4, dtype=torch.long)}
    mbs = micro_batches_of(batch, 2, group=1)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [2, 2, 1] and all(int(mb[CP_GROUP]) == 1 for mb in mbs)
    assert all(CP_GROUP not in mb for mb in micro_batches_of(batch, 2))


def test_validate_refuses_hybrid_placement_that_cannot_apply():
    from harness import compose_config

    from trainer.config import ConfigError, validate

    key = "strategy.context_parallel.placement"
    validate(compose_config([f"{key}=hybrid", "strategy=cp", "trainer.devices=2", "train.micro_batch_size=2"]))
    with pytest.raises(ConfigError, match="strategy.cp=1; set strategy.cp > 1 or placement=split"):
        validate(compose_config([f"{key}=hybrid"]))
    with pytest.raises(
        ConfigError, match="train.micro_batch_size=1 leaves no group at cp=2; set train.micro_batch_size >= 2"
    ):
        validate(compose_config([f"{key}=hybrid", "strategy=cp", "trainer.devices=2", "train.micro_batch_size=1"]))
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        validate(
            compose_config(
                [
                    f"{key}=hybrid",
                    "strategy=nd",
                    "strategy.cp=2",
                    "strategy.pp=2",
                    "strategy.dp_shard=1",
                    "trainer.devices=4",
                    "train.micro_batch_size=2",
                ]
            )
        )
    with pytest.raises(ConfigError, match="'spread' is unknown; use one of split, hybrid"):
        validate(compose_config([f"{key}=spread", "strategy=cp", "trainer.devices=2"]))


def test_group_sizes_keep_a_forward_within_a_split_one():
    assert group_sizes(4) == (1, 2) and group_sizes(4, 4) == (1, 2) and group_sizes(4, 2) == (2,)
    assert group_sizes(8, 2) == (4,) and group_sizes(6) == (1, 2) and group_sizes(2, 1) == ()
    # 16 tokens per shard at T = 64, cp = 4: a row fits 1 rank up to 16, 2 ranks up to 32
    docs = _rows([16, 16, 16, 16], [17, 47], [33, 31], [32, 32])
    assert fit_sizes(docs, 4, (1, 2)).tolist() == [1, 4, 4, 2]
    assert fit_sizes(docs, 4, (2,)).tolist() == [2, 4, 4, 2]
    assert fit_sizes(torch.zeros(3, 2, 64, dtype=torch.long), 4, (1, 2)).tolist() == [1, 1, 1]  # pairs: whole


def _brute_counts(fit: list[int], cp: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Lexicographically most rows on the smallest groups over every assignment of rows to sizes."""
    best = ()
    for choice in itertools.product((*sizes, cp), repeat=len(fit)):
        if any(c < f for c, f in zip(choice, fit)):
            continue
        counts = tuple(choice.count(g) for g in sizes)
        if all(n % (cp // g) == 0 for n, g in zip(counts, sizes)):
            best = max(best, counts)
    return best


@pytest.mark.parametrize("cp", [4, 8])
def test_row_counts_equal_brute_force(cp):
    rng = torch.Generator().manual_seed(cp)
    sizes = group_sizes(cp)
    options = torch.tensor([*sizes, cp])
    for _ in range(40):
        fit = options[
            torch.randint(len(options), (int(torch.randint(1, 7, (1,), generator=rng)),), generator=rng)
        ].tolist()
        prefix = [sum(f <= g for f in fit) for g in sizes]
        counts = row_counts(prefix, cp, sizes)
        assert tuple(counts[g] for g in sizes) == _brute_counts(fit, cp, sizes), fit


def test_least_prefix_counts_are_feasible_in_every_group():
    # two cp groups (cp = 4, T = 64): the least prefix counts give both the same counts, each feasible
    a = _rows(*[[8] * 8] * 5, [20, 44], [30, 34], [64])  # 5 rows fit 1, none more fit 2 (prefix 5, 5)
    b = _rows(*[[20] * 3 + [4]] * 6, [8] * 8, [64])  # 1 row fits 1, 6 more fit 2 (prefix 1, 7)
    sizes = group_sizes(4, 4)
    prefixes = [[int((fit_sizes(d, 4, sizes) <= g).sum()) for g in sizes] for d in (a, b)]
    counts = row_counts([min(p) for p in zip(*prefixes)], 4, sizes)
    assert counts == {1: 0, 2: 4}  # least prefix (1, 5): no 4 rows fit 1 everywhere, 4 rows fit 2
    for docs in (a, b):
        placed = plan_placement(docs, 4, counts)
        fit = fit_sizes(docs, 4, sizes)
        assert sorted(torch.cat([*placed.groups[2], placed.split]).tolist()) == list(range(8))
        assert [len(r) for r in placed.groups[2]] == [2, 2]
        assert all(fit[i] <= 2 for r in placed.groups[2] for i in r.tolist())


def test_sub_group_rows_balance_close_to_brute_force():
    work = torch.tensor([40.0, 7.0, 31.0, 3.0, 22.0, 18.0, 9.0, 12.0])
    placed = place_rows(work, 2)
    worst = max(float(work[p].sum()) for p in placed)
    best = min(
        max(float(work[list(c)].sum()), float(work.sum() - work[list(c)].sum()))
        for c in itertools.combinations(range(8), 4)
    )
    assert sorted(itertools.chain(*placed)) == list(range(8)) and worst <= best * 4 / 3


def test_hybrid_micro_batches_run_as_many_forwards_on_every_rank():
    from strategies.context.placement import hybrid_micro_batches

    docs = _rows(*[[8, 8, 8, 8, 8, 8, 8, 8]] * 4, [20, 20, 24], [30, 34], [24, 8, 32], [64])  # 4 fit 1, 2 fit 2
    batch = {"input_ids": docs * 100 + torch.arange(64), "document_ids": docs}

    def shard(rows, g, i):  # contiguous shards, enough to follow the tokens
        return {k: v.view(v.shape[0], g, -1)[:, i] for k, v in rows.items()}

    seen, shapes = [], []
    for rank in range(4):
        mbs, counts = hybrid_micro_batches(batch, cp=4, rank=rank, micro_batch_size=4, shard=shard)
        assert counts == {1: 4, 2: 2, 4: 2}
        shapes.append([(int(mb.get(CP_GROUP, 4)), mb["input_ids"].shape[0]) for mb in mbs])
        seen += [t for mb in mbs for t in mb["input_ids"].flatten().tolist()]
    assert shapes == [[(1, 1), (2, 1), (4, 2)]] * 4  # 1 whole row, 1 row on a pair of ranks, 2 split rows
    assert sorted(seen) == sorted(batch["input_ids"].flatten().tolist())  # every token once


def test_placement_problems_name_the_fix():
    assert placement_problems("hybrid", cp=4, pp=1, micro_batch_size=2) == []  # groups of 2 ranks fit
    (problem,) = placement_problems("hybrid", cp=4, pp=1, micro_batch_size=1)
    assert "set train.micro_batch_size >= 2" in problem


def test_validate_accepts_preference_pairs_under_cp_only_whole():
    from harness import compose_config

    from trainer.config import ConfigError, validate

    dpo = (
        "model=nano",
        "data=preference_synthetic",
        "train.global_batch_size=8",
        "strategy=cp",
        "trainer.devices=2",
        "train.micro_batch_size=2",
    )
    hybrid = "strategy.context_parallel.placement=hybrid"
    validate(compose_config([*dpo, hybrid], recipe="dpo", tiny=False))
    with pytest.raises(
        ConfigError, match="does not support strategy.cp=2 with placement=split .*context_parallel.placement=hybrid"
    ):
        validate(compose_config(list(dpo), recipe="dpo", tiny=False))
    with pytest.raises(ConfigError, match="train.micro_batch_size=1 < cp=2; set train.micro_batch_size >= 2"):
        validate(compose_config([*dpo, hybrid, "train.micro_batch_size=1"], recipe="dpo", tiny=False))
    with pytest.raises(
        ConfigError, match="gives 3 pairs per dp rank, not a multiple of cp=2; use a multiple of dp x cp = 4"
    ):
        validate(
            compose_config(
                [
                    *dpo,
                    hybrid,
                    "strategy=nd",
                    "strategy.dp_shard=2",
                    "strategy.cp=2",
                    "trainer.devices=4",
                    "train.global_batch_size=6",
                    "train.micro_batch_size=3",
                ],
                recipe="dpo",
                tiny=False,
            )
        )
