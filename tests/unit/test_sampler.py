"""GlobalBatchSampler: the global batches do not depend on the world size; resume starts mid-epoch."""

from __future__ import annotations

import torch

from trainer.data.loader import Loader, RowBatches
from trainer.data.sampler import GlobalBatchSampler


def _global_batches(num_rows: int, gbs: int, dp_size: int, **kw) -> list[list[int]]:
    per_rank = [
        list(GlobalBatchSampler(num_rows, global_batch_size=gbs, dp_rank=r, dp_size=dp_size, **kw))
        for r in range(dp_size)
    ]
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


def _loader(epoch: int = 0) -> Loader:
    sampler = GlobalBatchSampler(40, global_batch_size=4, seed=1)
    sampler.set_epoch(epoch)
    return Loader(RowBatches({"row": torch.arange(40)}, sampler))


def _rows(loader: Loader, mark: bool = True) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch["row"].tolist())
        if mark:
            loader.mark_trained()
    return out


def test_loader_resumes_at_trained_position() -> None:
    straight = _rows(_loader())
    resumed = _loader()
    iterator = iter(resumed)
    for _ in range(3):
        next(iterator)
        resumed.mark_trained()
    next(iterator)  # prefetched by Lightning but not trained: must not count
    state = resumed.state_dict()
    assert state == {"epoch": 0, "trained": 3}
    fresh = _loader()
    fresh.load_state_dict(state)
    # The length is the whole epoch's (Lightning ends a resumed epoch when its restored batch
    # count reaches it, case C07), while iteration continues at the first batch not trained.
    assert len(fresh) == 10
    assert _rows(fresh) == straight[3:]
    assert _rows(fresh) == straight  # the whole epoch trained: the next iteration starts at its beginning


def test_loader_resumes_after_the_last_batch_of_an_epoch_in_the_next_one() -> None:
    loader = _loader()
    _rows(loader)
    fresh = _loader()
    fresh.load_state_dict(loader.state_dict())
    assert fresh.state_dict() == {"epoch": 1, "trained": 0}
    assert _rows(fresh) == _rows(_loader(epoch=1))  # the next epoch's order, from its first batch


def test_pinned_loader_hands_out_page_locked_batches(monkeypatch) -> None:
    # No CUDA here: Tensor.pin_memory is replaced by a marker (a pinned batch is then copied with non_blocking).
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())
    sampler = GlobalBatchSampler(num_rows=40, global_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    batches = list(Loader(RowBatches({"row": torch.arange(40)}, sampler), pin_memory=True))
    assert len(pinned) == len(batches) == 5 and all(p is not b["row"] for p, b in zip(pinned, batches))
    assert not list(iter(_loader()))[0]["row"].is_pinned()
