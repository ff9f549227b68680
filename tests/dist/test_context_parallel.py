"""Ring, Ulysses and hybrid attention in real gloo ranks equal one-process attention (fp32, 1e-5).

Each rank keeps its zigzag (or contiguous) shard of q, k, v, runs `ContextParallelAttention` and
backpropagates its shard of a fixed output gradient; the shards of the outputs and of the q/k/v
gradients are put back in sequence order and compared with `SDPAttention` (the model's default
core) on the whole sequence. GQA with 8 query and 4 kv heads. Rows are either plain causal or
packed, with documents of 5, 13, 9 and 5 tokens: at T=32 and cp=4 (chunks of 4 tokens) every
document boundary falls inside a shard, and each document spans several shards.
"""

from __future__ import annotations

import pytest
import torch

from strategies.context import (
    ContextParallelAttention, build_cp_layout, causal_work, shard_batch, shard_positions, ulysses_degree_for,
)  # fmt: skip
from strategies.gloo import run_gloo_ranks
from trainer.models.attention import SDPA

B, T, H, K, E = 2, 32, 8, 4, 8
DOC_LENGTHS = (5, 13, 9, 5)
TOL = {"rtol": 1e-5, "atol": 1e-5}
# (mode, cp, load_balance, kv_chunk)
CASES = {
    2: [("ring", 2, True, 0), ("ulysses", 2, True, 0), ("ring", 2, False, 3)],
    4: [("ring", 4, True, 0), ("ulysses", 4, True, 0), ("hybrid", 4, True, 0), ("hybrid", 4, False, 5)],
}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(B, T, H, E, generator=g), torch.randn(B, T, H, E, generator=g)
    k, v = torch.randn(B, T, K, E, generator=g), torch.randn(B, T, K, E, generator=g)
    docs = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), torch.tensor(DOC_LENGTHS))
    docs = torch.stack([docs, docs.flip(0)])  # the second row has its documents in reverse order
    return {"q": q, "k": k, "v": v, "dout": dout, "docs": docs}


def reference(packed: bool) -> dict[str, torch.Tensor]:
    x = inputs()
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    out = SDPA(q, k, v, SDPA.mask(x["docs"] if packed else None, T))
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _rank_results(rank: int, world: int) -> dict:
    results = {}
    x = inputs()
    for mode, cp, load_balance, kv_chunk in CASES[world]:
        layout = build_cp_layout([list(range(world))], ulysses_degree=ulysses_degree_for(mode, cp, 2))
        core = ContextParallelAttention(layout, load_balance=load_balance, kv_chunk=kv_chunk)
        index = shard_positions(T, cp, rank, load_balance=load_balance)
        for packed in (False, True):
            q, k, v = (x[n][:, index].clone().requires_grad_() for n in "qkv")
            out = core(q, k, v, core.mask(x["docs"][:, index] if packed else None, len(index)))
            out.backward(x["dout"][:, index])
            # numpy arrays travel to the parent by value (tensors may go as shared-memory handles
            # that vanish when the rank exits).
            results[(mode, cp, load_balance, kv_chunk, packed)] = {
                "index": index.numpy(), "out": out.detach().numpy(), "dq": q.grad.numpy(),
                "dk": k.grad.numpy(), "dv": v.grad.numpy(),
            }  # fmt: skip
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_equals_one_process(world):
    by_rank = run_gloo_ranks(world, lambda rank: _rank_results(rank, world), timeout_s=120)
    refs = {packed: reference(packed) for packed in (False, True)}
    for case in by_rank[0]:
        packed = case[-1]
        for name, expected in refs[packed].items():
            got = torch.empty_like(expected)
            for results in by_rank:
                got[:, torch.from_numpy(results[case]["index"])] = torch.from_numpy(results[case][name])
            torch.testing.assert_close(got, expected, **TOL, msg=f"{name} of {case}")


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
