"""Ring, Ulysses and hybrid attention in real gloo ranks equal one-process attention (fp32, 1e-5).

Each rank keeps its zigzag (or contiguous) shard of q, k, v, runs `ContextParallelAttention` and
backpropagates its shard of a fixed output gradient; the shards of the outputs and of the q/k/v
gradients are put back in sequence order and compared with dense-mask SDPA on the whole sequence,
written here (k/v repeated to the query heads, a boolean ``[B, 1, T, T]`` block-causal mask: the
attention plait had before its document kernels). GQA with 8 query and 4 kv heads. Rows are
either plain causal or packed, with documents of 5, 13, 9 and 5 tokens: at T=32 and cp=4 (chunks
of 4 tokens) every document boundary falls inside a shard, and each document spans several
shards. Both block kernels run: eager fp32 (the CPU default) and fused (the CPU flash kernel,
through the code the CUDA memory-efficient kernel shares).

bf16: under CPU bf16 autocast with bf16 q/k/v, every layout's output error against an fp64
reference is at most 1.5x that of one-process bf16 SDPA on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strategies.context.attention import ContextParallelAttention
from strategies.context.layout import build_cp_layout
from strategies.context.plugin import ulysses_degree_for
from strategies.context.sharding import causal_work, shard_batch, shard_positions
from strategies.runtime.gloo import run_gloo_ranks

B, T, H, K, E = 2, 32, 8, 4, 8
DOC_LENGTHS = (5, 13, 9, 5)
TOL = {"rtol": 1e-5, "atol": 1e-5}
# (mode, cp, load_balance, kv_chunk, kernel)
CASES = {
    2: [("ring", 2, True, 0, "eager"), ("ulysses", 2, True, 0, "eager"), ("ring", 2, False, 3, "eager"),
        ("ring", 2, True, 0, "fused"), ("ulysses", 2, True, 0, "fused")],
    4: [("ring", 4, True, 0, "eager"), ("ulysses", 4, True, 0, "eager"), ("hybrid", 4, True, 0, "eager"),
        ("hybrid", 4, False, 5, "eager"), ("ring", 4, True, 0, "fused"), ("hybrid", 4, False, 5, "fused")],
}  # fmt: skip
BF16_MODES = {2: ("ring", "ulysses"), 4: ("ring", "ulysses", "hybrid")}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(B, T, H, E, generator=g), torch.randn(B, T, H, E, generator=g)
    k, v = torch.randn(B, T, K, E, generator=g), torch.randn(B, T, K, E, generator=g)
    docs = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), torch.tensor(DOC_LENGTHS))
    docs = torch.stack([docs, docs.flip(0)])  # the second row has its documents in reverse order
    return {"q": q, "k": k, "v": v, "dout": dout, "docs": docs}


def dense_sdpa(q, k, v, docs):  # noqa: ANN001, ANN201
    """``[B, T, H, E]`` attention through SDPA with k/v repeated and a dense mask (None: is_causal)."""
    q, k, v = (
        q.transpose(1, 2),
        k.repeat_interleave(H // K, 2).transpose(1, 2),
        v.repeat_interleave(H // K, 2).transpose(1, 2),
    )
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    mask = (docs[:, :, None] == docs[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


def reference(packed: bool) -> dict[str, torch.Tensor]:
    x = inputs()
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out = dense_sdpa(q, k, v, x["docs"] if packed else None)
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _core(world: int, mode: str, cp: int, load_balance: bool, kv_chunk: int, kernel: str) -> ContextParallelAttention:
    layout = build_cp_layout([list(range(world))], ulysses_degree=ulysses_degree_for(mode, cp, 2))
    return ContextParallelAttention(layout, load_balance=load_balance, kv_chunk=kv_chunk, kernel=kernel)


def _rank_results(rank: int, world: int) -> dict:
    results = {}
    x = inputs()
    for mode, cp, load_balance, kv_chunk, kernel in CASES[world]:
        core = _core(world, mode, cp, load_balance, kv_chunk, kernel)
        index = shard_positions(T, cp, rank, load_balance=load_balance)
        for packed in (False, True):
            q, k, v = (x[n][:, index].clone().requires_grad_() for n in "qkv")
            out = core(q, k, v, core.mask(x["docs"][:, index] if packed else None, len(index), q.device))
            out.backward(x["dout"][:, index])
            # numpy arrays travel to the parent by value (tensors may go as shared-memory handles
            # that vanish when the rank exits).
            results[(mode, cp, load_balance, kv_chunk, kernel, packed)] = {
                "index": index.numpy(), "out": out.detach().numpy(), "dq": q.grad.numpy(),
                "dk": k.grad.numpy(), "dv": v.grad.numpy(),
            }  # fmt: skip
    for mode in BF16_MODES[world]:
        core = _core(world, mode, world, True, 0, "auto")
        index = shard_positions(T, world, rank)
        q, k, v = (x[n][:, index].bfloat16() for n in "qkv")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = core(q, k, v, core.mask(x["docs"][:, index], len(index), q.device))
        results[("bf16", mode)] = {"index": index.numpy(), "out": out.float().numpy()}
    return results


def _gather(by_rank: list[dict], case: tuple, name: str, like: torch.Tensor) -> torch.Tensor:
    got = torch.empty_like(like)
    for results in by_rank:
        got[:, torch.from_numpy(results[case]["index"])] = torch.from_numpy(results[case][name])
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_equals_one_process(world):
    by_rank = run_gloo_ranks(world, lambda rank: _rank_results(rank, world), timeout_s=120)
    refs = {packed: reference(packed) for packed in (False, True)}
    for case in (c for c in by_rank[0] if c[0] != "bf16"):
        for name, expected in refs[case[-1]].items():
            torch.testing.assert_close(_gather(by_rank, case, name, expected), expected, **TOL, msg=f"{name} of {case}")
    # bf16: the error of each layout against fp64, relative to one-process bf16 SDPA's.
    x = inputs()
    q, k, v = (x[n].bfloat16() for n in "qkv")
    exact = dense_sdpa(q.double(), k.double(), v.double(), x["docs"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa_err = (dense_sdpa(q, k, v, x["docs"]).double() - exact).abs().mean()
    for mode in BF16_MODES[world]:
        got = _gather(by_rank, ("bf16", mode), "out", exact.float()).double()
        err = (got - exact).abs().mean()
        assert err <= 1.5 * sdpa_err, f"bf16 {mode} cp={world}: error {err:.2e} > 1.5 x SDPA's {sdpa_err:.2e}"


def test_reference_masks_documents():
    """The reference is block-diagonal: packed and plain causal outputs differ (the test can fail)."""
    assert not torch.allclose(reference(True)["out"], reference(False)["out"], atol=1e-3)


def test_shard_positions_zigzag_and_contiguous():
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_positions(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]
    everything = torch.cat([shard_positions(24, 3, r) for r in range(3)]).sort().values
    assert everything.tolist() == list(range(24))
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_positions(12, 4, 0)


def test_shard_batch_keeps_targets_with_their_positions():
    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1}
    shard = shard_batch(batch, cp=2, rank=1)
    assert shard["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(shard["labels"], shard["input_ids"] + 1)
    assert shard["position_ids"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]


def test_load_balancing_evens_causal_work():
    causal = torch.zeros(64, dtype=torch.long)
    balanced, contiguous = causal_work(causal, 4, load_balance=True), causal_work(causal, 4, load_balance=False)
    assert max(balanced) == min(balanced) and sum(balanced) == sum(contiguous) == 64 * 65 // 2
    assert max(contiguous) / (sum(contiguous) / 4) == pytest.approx(1.75, abs=0.02)
