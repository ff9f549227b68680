"""The work model and planner of `trainer.data.balance`, and the loaders that apply it.

The reference counts are plain Python written here: a token attends the earlier tokens of its
document (a run of equal document ids) and itself.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from trainer.data.balance import Balancer, WorkModel, causal_pairs, cells, plan, step_cost
from trainer.data.loader import PackedBatches, RowBatches
from trainer.data.packing import Packer, SampleList, pack
from trainer.data.sampler import GlobalBatchSampler


def pairs_reference(row: list[int]) -> int:
    total, run = 0, 0
    for t, doc in enumerate(row):
        run = run + 1 if t and doc == row[t - 1] else 1
        total += run
    return total


def test_causal_pairs_count_each_documents_triangle():
    rng = random.Random(0)
    rows = [sorted(rng.choices(range(5), k=40)) for _ in range(6)] + [[0] * 40, list(range(40))]
    got = causal_pairs(torch.tensor(rows))
    assert got.tolist() == [pairs_reference(r) for r in rows]
    assert got[-2] == 40 * 41 // 2 and got[-1] == 40


def test_work_of_a_record_of_several_sequences_sums_them():
    model = WorkModel(linear_per_token=2.0, attention_per_pair=3.0)
    ids = torch.tensor([[[0, 0, 1], [0, 0, 0]]])  # one pair of 3-token rows
    assert model.rows(ids).tolist() == [2.0 * 6 + 3.0 * ((3 + 1) + 6)]


def brute_force_cost(work: torch.Tensor, dp: int, micro: int) -> float:
    return min(
        step_cost(cells(work[list(p)], dp_size=dp, micro_batch_size=micro))
        for p in itertools.permutations(range(len(work)))
    )


@pytest.mark.parametrize("dp,micro", [(2, 1), (2, 2), (3, 1)])
def test_plan_is_a_permutation_and_finds_the_best_order_of_small_batches(dp, micro):
    rng = random.Random(dp * 10 + micro)
    for _ in range(5):
        n = dp * 2 if micro == 1 else dp * 3
        work = torch.tensor([float(rng.choice([1, 1, 2, 9, 30])) for _ in range(n)])
        order = plan(work, dp_size=dp, micro_batch_size=micro)
        assert sorted(order.tolist()) == list(range(n))
        got = step_cost(cells(work[order], dp_size=dp, micro_batch_size=micro))
        assert got <= step_cost(cells(work, dp_size=dp, micro_batch_size=micro))
        assert got <= 1.2 * brute_force_cost(work, dp, micro)


def test_plan_balances_a_long_tail_and_keeps_balanced_batches():
    rng = random.Random(1)
    work = torch.tensor([float(rng.choice([1.0] * 6 + [40.0])) for _ in range(64)])
    order = plan(work, dp_size=4, micro_batch_size=4)
    ranks = work[order].reshape(4, -1).sum(1)
    assert ranks.max() / ranks.mean() < work.reshape(4, -1).sum(1).max() / ranks.mean()
    assert ranks.max() - ranks.min() <= 40.0  # at most one heavy row apart
    assert torch.equal(plan(torch.ones(16), dp_size=4, micro_batch_size=2), torch.arange(16))
    assert torch.equal(order, plan(work.clone(), dp_size=4, micro_batch_size=4))  # deterministic


def _rows(num: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    samples = [([rng.randrange(50)] * n, [1] * n) for n in (rng.choice([3, 5, 8, 40, 90]) for _ in range(num))]
    return vars(pack(samples, seq_len=seq_len, pad_id=0))


def test_row_batches_balanced_train_the_same_rows_per_step_and_resume_exactly():
    rows = _rows(200, 32, 0)
    balancer = Balancer(WorkModel(), micro_batch_size=2)
    dp, gbs = 2, 8

    def stream(rank: int, balanced: bool) -> RowBatches:
        sampler = GlobalBatchSampler(len(rows["input_ids"]), global_batch_size=gbs, dp_rank=rank, dp_size=dp, seed=3)
        return RowBatches(rows, sampler, balancer if balanced else None)

    def steps(balanced: bool, start=None) -> list[list[torch.Tensor]]:
        streams = [stream(r, balanced) for r in range(dp)]
        its = [s.batches(start or s.start()) for s in streams]
        return [[b["input_ids"] for b, _, _ in per_rank] for per_rank in zip(*its)]

    plain, balanced = steps(False), steps(True)
    assert len(plain) == len(balanced) > 3
    moved = 0
    for a, b in zip(plain, balanced):
        key = lambda t: sorted(map(tuple, torch.cat(t).tolist()))  # noqa: E731
        assert key(a) == key(b)  # the same rows in the step
        moved += not torch.equal(torch.cat(a), torch.cat(b))
    assert moved >= len(plain) // 2
    resumed = steps(True, {"epoch": 0, "trained": 3})
    assert all(torch.equal(torch.cat(x), torch.cat(y)) for x, y in zip(resumed, balanced[3:]))


def test_packed_batches_balanced_train_the_same_rows_per_step():
    rng = random.Random(2)
    samples = [(np.full(n, 7), np.ones(n, dtype=np.int64)) for n in (rng.choice([3, 5, 40, 60]) for _ in range(120))]
    make = lambda: Packer(SampleList(samples), seq_len=32, pad_id=0, policy="whole")  # noqa: E731

    def steps(balancer: Balancer | None) -> list[torch.Tensor]:
        its = [
            PackedBatches(make, names=["a"], global_batch_size=8, dp_rank=r, dp_size=2, balancer=balancer)
            for r in range(2)
        ]
        return [
            torch.cat([b["document_ids"] for b, _, _ in per_rank])
            for per_rank in zip(*(s.batches(s.start()) for s in its))
        ]

    plain, balanced = steps(None), steps(Balancer(WorkModel(), micro_batch_size=1))
    assert len(plain) == len(balanced)
    assert any(not torch.equal(a, b) for a, b in zip(plain, balanced))
    for a, b in zip(plain, balanced):
        assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist()))


def test_validate_refuses_balance_that_cannot_apply():
    from harness import compose_config

    from trainer.config import ConfigError, validate

    validate(compose_config(["data.balance=work", "strategy=ddp", "trainer.devices=2"]))  # two dp ranks: accepted
    with pytest.raises(ConfigError, match="data.balance=work has nothing to balance"):
        validate(
            compose_config(["data.balance=work", "train.micro_batch_size=2"])
        )  # one rank: the order changes nothing
    with pytest.raises(ConfigError, match="data.balance='tokens' must be one of none, work"):
        validate(compose_config(["data.balance=tokens"]))
