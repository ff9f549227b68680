"""A Llama or an MoE transformer built on the meta device, parallelized, then materialised and
initialised shard by shard, holds bitwise the weights of the one-process model of the same seed
(gloo, 2 or 4 ranks).

Llama layouts: FSDP2 over 4 ranks (uneven dim-0 chunks: 97 vocabulary rows), TP 2 with sequence
parallelism, and FSDP2 2 x TP 2 (2-D DTensors, the strided dim-0 shards of column-wise weights).
MoE layouts (a dense block, then a block of 4 routed experts, a shared expert and latent attention):
FSDP2 over 2 ranks, and expert parallelism 2 with the experts' own FSDP 2 over 4 ranks (each ep
rank holds 2 experts, split again over efsdp), through `strategies.expert.plugin.ExpertParallel`.
Each rank fills only its shards (`Llama.init_weights` after ``to_empty``); the test gathers every
parameter with ``full_tensor`` and compares it with a plain model built on CPU. A block size
smaller than the tensors makes every parameter span several seeded blocks.
"""

from __future__ import annotations

import pytest
import torch

from strategies.runtime.gloo import run_gloo_ranks
from trainer.models import init
from trainer.models.llama import Llama
from trainer.models.moe_transformer import MoETransformer

NANO = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qkv_bias=True)
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
NANO_MOE = dict(NANO, num_experts=4, top_k=2, moe_ffn_dim=32, n_dense_layers=1, num_shared_experts=1,
                latent_attention=MLA)
LAYOUTS = {"fsdp4": (4, 1), "tp2": (1, 2), "fsdp2_tp2": (2, 2)}  # (dp_shard, tp); world = their product
MOE_LAYOUTS = {"moe_fsdp2": (2, 1), "moe_fsdp2_ep2": (4, 2)}  # (dp_shard, ep)
BLOCK = 1000  # elements per seeded block: several blocks per weight (64 x 64 = 4096; an expert 2048)


def reference(monkeypatch, model_cls=Llama, shape=NANO) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(init, "BLOCK_ELEMENTS", BLOCK)
    torch.manual_seed(7)
    return {k: v.clone() for k, v in model_cls(**shape).state_dict().items()}


def _gathered(model) -> dict:
    return {k: v.full_tensor().numpy() if hasattr(v, "full_tensor") else v.numpy() for k, v in model.state_dict().items()}


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
    return _gathered(model)


def _moe_rank(rank: int, layout: str) -> dict:
    from strategies.expert.plugin import ExpertParallel
    from strategies.fsdp import FSDP, apply_fsdp
    from strategies.core.parallel_dims import Meshes, ParallelDims

    init.BLOCK_ELEMENTS = BLOCK
    dp, ep = MOE_LAYOUTS[layout]
    root, views = ParallelDims(dp_shard=dp).build_mesh("cpu")
    torch.manual_seed(7)
    with torch.device("meta"):
        model = MoETransformer(**NANO_MOE)
    if ep > 1:
        plugin = ExpertParallel(ep=ep)
        meshes = Meshes(root, views, root["dp_shard"], torch.device("cpu"), plugins={"fsdp": FSDP()})
        assert plugin.apply(model, meshes) == 1
    apply_fsdp(model, dp_mesh=root["dp_shard"])
    model.to_empty(device="cpu")
    model.init_weights()
    return _gathered(model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_built_shards_hold_the_one_process_weights(layout, monkeypatch):
    by_rank = run_gloo_ranks(LAYOUTS[layout][0] * LAYOUTS[layout][1], lambda rank: _rank(rank, layout), timeout_s=120)
    expected = reference(monkeypatch)
    assert set(by_rank[0]) == set(expected)
    for name, want in expected.items():
        assert torch.equal(torch.from_numpy(by_rank[0][name]), want), name


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_meta_built_moe_shards_hold_the_one_process_weights(layout, monkeypatch):
    by_rank = run_gloo_ranks(MOE_LAYOUTS[layout][0], lambda rank: _moe_rank(rank, layout), timeout_s=120)
    expected = reference(monkeypatch, MoETransformer, NANO_MOE)
    assert set(by_rank[0]) == set(expected)
    assert "layers.1.feed_forward.experts.w2" in expected and "layers.1.attention.wkv_a.weight" in expected
    for name, want in expected.items():
        assert torch.equal(torch.from_numpy(by_rank[0][name]), want), name
