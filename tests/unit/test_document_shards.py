"""Document-aware cp sharding (`strategies.context.document_shards`): a layout the zigzag masks read exactly,
with even causal work per rank on packed rows.

The checks are written here: a token's causal work is its index in its document plus one (counted
in plain Python), and the zigzag attention core orders keys by slot (chunk k before chunk k + 1),
so the layout is exact iff every document's tokens keep their order along the slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from strategies.context.document_shards import document_zigzag_order, rank_causal_work
from strategies.context.plugin import ContextParallel
from strategies.context.sharding import shard_batch, shard_positions


def packed(seq_len: int, rng: random.Random, low: int, high: int) -> torch.Tensor:
    ids, doc = [], 0
    while len(ids) < seq_len:
        ids += [doc] * rng.randint(low, high)
        doc += 1
    return torch.tensor(ids[:seq_len])


def work_reference(docs: list[int], tokens: list[int]) -> int:
    index_in_doc = [0] * len(docs)
    for t in range(1, len(docs)):
        index_in_doc[t] = index_in_doc[t - 1] + 1 if docs[t] == docs[t - 1] else 0
    return sum(index_in_doc[t] + 1 for t in tokens)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_order_is_a_permutation_that_keeps_each_documents_order(cp):
    rng = random.Random(cp)
    for seq_len, low, high in [(96, 1, 9), (240, 5, 70), (48, 48, 48)]:
        docs = packed(seq_len, rng, low, high)
        order = document_zigzag_order(docs, cp)
        assert sorted(order.tolist()) == list(range(seq_len))
        for d in docs.unique():
            slots = order[docs[order] == d]  # the document's original indices, in slot order
            assert torch.equal(slots, slots.sort().values)


def test_one_document_rows_shard_as_plain_zigzag():
    docs = torch.zeros(64, dtype=torch.long)
    assert torch.equal(document_zigzag_order(docs, 4), torch.arange(64))
    batch = {"input_ids": torch.arange(128).view(2, 64), "document_ids": torch.zeros(2, 64, dtype=torch.long)}
    for rank in range(2):
        got = shard_batch(batch, cp=2, rank=rank, documents=True)
        assert torch.equal(got["input_ids"], shard_batch(batch, cp=2, rank=rank)["input_ids"])


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_even_on_packed_rows_of_random_documents(cp):
    rng = random.Random(10 + cp)
    for _ in range(4):
        docs = packed(16384, rng, 32, 4096)
        order = document_zigzag_order(docs, cp)
        zigzag, document = [], []
        for r in range(cp):
            slots = shard_positions(16384, cp, r)
            zigzag.append(rank_causal_work(docs, slots))
            document.append(rank_causal_work(docs, order[slots]))
        assert document[0] == work_reference(docs.tolist(), order[shard_positions(16384, cp, 0)].tolist())
        assert max(document) / (sum(document) / cp) <= 1.05
    assert max(zigzag) / (sum(zigzag) / cp) > 1.05  # what zigzag alone leaves


def test_sharded_rows_hold_every_token_once():
    rng = random.Random(5)
    docs = torch.stack([packed(32, rng, 1, 12) for _ in range(3)])
    batch = {
        "input_ids": torch.arange(96).view(3, 32),
        "document_ids": docs,
        "labels": torch.arange(96).view(3, 32) + 1000,
    }
    parts = [shard_batch(batch, cp=2, rank=r, documents=True) for r in range(2)]
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    assert torch.equal(ids.sort(dim=1).values, batch["input_ids"])
    assert torch.equal(torch.cat([p["labels"] for p in parts], dim=1), ids + 1000)  # targets travel with tokens


def test_sharding_option_is_checked():
    assert ContextParallel(sharding="contiguous").load_balance is False
    with pytest.raises(ValueError, match="keep load_balance=true"):
        ContextParallel(sharding="document", load_balance=False)
    with pytest.raises(ValueError, match="use one of zigzag, contiguous, document"):
        ContextParallel(sharding="striped")
