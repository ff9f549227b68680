"""GlobalBatchSampler: the global batches do not depend on the world size; resume starts mid-epoch."""

from __future__ import annotations

import torch

from trainer.data.sampler import GlobalBatchSampler, StatefulLoader


def _global_batches(num_rows: int, gbs: int, dp_size: int, **kw) -> list[list[int]]:
    per_rank = [list(GlobalBatchSampler(num_rows, global_batch_size=gbs, dp_rank=r, dp_size=dp_size, **kw)) for r in range(dp_size)]
    return [sum((per_rank[r][k] for r in range(dp_size)), []) for k in range(len(per_rank[0]))]


def test_same_global_batches_at_any_dp_size() -> None:
    one = _global_batches(50, 8, 1, seed=3)
    assert one == _global_batches(50, 8, 2, seed=3) == _global_batches(50, 8, 4, seed=3)
    assert len(one) == 6 and len({i for b in one for i in b}) == 48  # drop_last: 2 rows left out


def test_epochs_reshuffle_deterministically() -> None:
    sampler = GlobalBatchSampler(40, global_batch_size=8, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_partial_last_batch_is_trimmed_to_dp_multiple() -> None:
    batches = _global_batches(21, 8, 2, shuffle=False, drop_last=False)
    assert [len(b) for b in batches] == [8, 8, 4]  # 5 rows left -> 4 = 2 per rank


def test_partial_batch_below_dp_size_is_dropped() -> None:
    assert [len(b) for b in _global_batches(17, 8, 2, shuffle=False, drop_last=False)] == [8, 8]


def test_loader_resumes_at_trained_position() -> None:
    rows = torch.arange(40)
    loader = StatefulLoader(rows, GlobalBatchSampler(40, global_batch_size=4, seed=1))
    straight = [b.tolist() for b in loader]
    resumed = StatefulLoader(rows, GlobalBatchSampler(40, global_batch_size=4, seed=1))
    iterator = iter(resumed)
    for _ in range(3):
        next(iterator)
        resumed.mark_trained()
    next(iterator)  # prefetched by Lightning but not trained: must not count
    state = resumed.state_dict()
    assert state == {"epoch": 0, "trained": 3}
    fresh = StatefulLoader(rows, GlobalBatchSampler(40, global_batch_size=4, seed=1))
    fresh.load_state_dict(state)
    # The length is the whole epoch's (Lightning ends a resumed epoch when its restored batch
    # count reaches it, case C07), while iteration continues at the first batch not trained.
    assert len(fresh) == 10
    assert [b.tolist() for b in fresh] == straight[3:]
    assert [b.tolist() for b in fresh] == straight  # the next epoch starts from its beginning
