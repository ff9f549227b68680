"""A Llama built on the meta device, parallelized, then materialised and initialised shard by shard,
holds bitwise the weights of the one-process model of the same seed (gloo, 2 or 4 ranks).

Layouts: FSDP2 over 4 ranks (uneven dim-0 chunks: 97 vocabulary rows), TP 2 with sequence
parallelism, and FSDP2 2 x TP 2 (2-D DTensors, the strided dim-0 shards of column-wise weights).
Each rank fills only its shards (`Llama.init_weights` after ``to_empty``); the test gathers every
parameter with ``full_tensor`` and compares it with a plain model built on CPU. A block size
smaller than the tensors makes every parameter span several seeded blocks.
"""

from __future__ import annotations

import pytest
import torch

from strategies.gloo import run_gloo_ranks
from trainer.models import init
from trainer.models.llama import Llama

NANO = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qkv_bias=True)
LAYOUTS = {"fsdp4": (4, 1), "tp2": (1, 2), "fsdp2_tp2": (2, 2)}  # (dp_shard, tp); world = their product
BLOCK = 1000  # elements per seeded block: several blocks per weight (64 x 64 = 4096 elements)


def reference(monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(init, "BLOCK_ELEMENTS", BLOCK)
    torch.manual_seed(7)
    return {k: v.clone() for k, v in Llama(**NANO).state_dict().items()}


def _rank(rank: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from strategies.fsdp import apply_fsdp
    from strategies.tensor import apply_tensor_parallel

    init.BLOCK_ELEMENTS = BLOCK  # a forked rank: its own copy of the module
    dp, tp = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(7)
    with torch.device("meta"):
        model = Llama(**NANO)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], model.tp_plan())
    if dp > 1:
        apply_fsdp(model, dp_mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    model.init_weights()
    return {k: v.full_tensor().numpy() if hasattr(v, "full_tensor") else v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_built_shards_hold_the_one_process_weights(layout, monkeypatch):
    by_rank = run_gloo_ranks(LAYOUTS[layout][0] * LAYOUTS[layout][1], lambda rank: _rank(rank, layout), timeout_s=120)
    expected = reference(monkeypatch)
    assert set(by_rank[0]) == set(expected)
    for name, want in expected.items():
        assert torch.equal(torch.from_numpy(by_rank[0][name]), want), name
