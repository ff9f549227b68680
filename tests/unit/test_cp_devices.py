"""Context-parallel positions live on the batch's device (CUDA in a real run; the meta device
here stands for any device that is not the host), also when a row has no ``document_ids``."""

from __future__ import annotations

import torch

from strategies.context.attention import ContextParallelAttention
from strategies.context.layout import CPLayout
from strategies.context.sharding import shard_batch

META = torch.device("meta")


def test_ring_masks_without_document_ids_are_on_the_activations_device() -> None:
    layout = CPLayout(cp=2, index=1, cp_group=None, ulysses_degree=1, ulysses_group=None, ring=None)
    masks = ContextParallelAttention(layout).mask(None, 8, META)  # no collective without document ids
    assert masks.doc_q is None and masks.pos_q.device == META
    assert all(p.device == META for p in masks.pos_kv)
    assert all(p.device.type == "cpu" for p in masks.pos_kv_host)  # block skipping reads these, no sync
    assert masks.last_query == 11  # zigzag over 16 tokens: rank 1 of 2 holds chunks 1 and 2 of 4 (positions 4-11)
    assert masks.allowed(0, 0, 8).device == META


def test_shard_batch_fills_positions_on_the_batch_device() -> None:
    batch = {
        "input_ids": torch.empty(2, 8, dtype=torch.long, device=META),
        "labels": torch.empty(2, 8, dtype=torch.long, device=META),
    }
    shard = shard_batch(batch, cp=2, rank=0)
    assert shard["position_ids"].device == META and shard["position_ids"].shape == (2, 4)
