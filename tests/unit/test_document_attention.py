"""Document-causal attention without a dense mask equals dense-mask SDPA (fp32, 1e-5).

The reference is written here: SDPA with k/v repeated to the query heads and a boolean
``[B, 1, T, T]`` block-causal mask (plait's attention before its document kernels). Checked: the
CPU path (`PackedDocuments`: causal SDPA per document length) outputs and dq/dk/dv, FlexAttention's
forward with the document ``BlockMask`` (eager, CPU), the dense fallback for ids whose documents are
not contiguous runs, plain causal rows, and the ring attention fused kernels' CUDA calls on meta
tensors (shapes and signatures).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strategies.context.attention_blocks import FusedBlocks
from trainer.models.attention import DOCUMENT_CAUSAL
from trainer.models.document_masks import (
    PackedDocuments,
    document_block_mask,
    flex_document_attention,
    pack_documents,
)

B, T, H, K, E = 2, 64, 8, 4, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}
CPU = torch.device("cpu")


def dense_reference(q, k, v, docs):  # noqa: ANN001, ANN201
    qh, kh, vh = (
        q.transpose(1, 2),
        k.repeat_interleave(H // K, 2).transpose(1, 2),
        v.repeat_interleave(H // K, 2).transpose(1, 2),
    )
    mask = (docs[:, :, None] == docs[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None]).transpose(1, 2)


def tensors(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, dout = torch.randn(B, T, H, E, generator=g), torch.randn(B, T, H, E, generator=g)
    k, v = torch.randn(B, T, K, E, generator=g), torch.randn(B, T, K, E, generator=g)
    return q, k, v, dout


def docs_of(*lengths_per_row: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths_per_row])


# A one-token document, a row that is one document, documents that straddle nothing in particular.
PACKED = docs_of((5, 30, 1, 20, 8), (64,))
ODD = docs_of((13, 17, 9, 25), (3, 3, 58))


@pytest.mark.parametrize("docs", [PACKED, ODD], ids=["lengths", "odd_lengths"])
def test_cpu_path_equals_dense_mask_sdpa(docs):
    q, k, v, dout = tensors()
    mask = DOCUMENT_CAUSAL.mask(docs, T, CPU)
    assert isinstance(mask, PackedDocuments)
    grads = []
    for fn in (lambda *a: DOCUMENT_CAUSAL(*a, mask), lambda *a: dense_reference(*a, docs)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        grads.append([out.detach(), *(t.grad for t in leaves)])
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *grads):
        torch.testing.assert_close(got, expected, **TOL, msg=name)


def test_documents_grouped_by_length():
    docs = pack_documents(docs_of((5, 20, 5, 20, 14), (64,)))
    assert docs.lengths == (5, 14, 20, 64) and [g.numel() for g in docs.gather] == [10, 14, 40, 64]
    assert sorted(docs.order.tolist()) == list(range(B * T))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_dense_mask_sdpa():
    q, k, v, _ = tensors(1)
    out = flex_document_attention(q, k, v, document_block_mask(ODD, compiled=False), compiled=False)
    torch.testing.assert_close(out, dense_reference(q, k, v, ODD), **TOL)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_attention_sinks_through_flex_equal_the_written_out_softmax_with_the_sink():
    """GPT-OSS's sinks (a logit per head in each softmax's denominator): Flex's output scaled by
    sigmoid(lse - sink) (CUDA's path, here its eager forward) equals `sink_attention` with the dense
    mask (CPU's path), which equals the softmax over the keys and the sink written out here."""
    from trainer.models.attention import sink_attention

    q, k, v, _ = tensors(2)
    sinks_h = torch.randn(H, generator=torch.Generator().manual_seed(3))
    block = document_block_mask(ODD, compiled=False)
    flex = flex_document_attention(q, k, v, block, compiled=False, sinks_h=sinks_h)
    mask = (ODD[:, :, None] == ODD[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    written = sink_attention(q, k, v, mask[:, None], sinks_h)
    torch.testing.assert_close(flex, written, **TOL)
    scores = torch.einsum("bthe,bshe->bhts", q, k.repeat_interleave(H // K, 2)) / E**0.5
    weights = scores.masked_fill(~mask[:, None], float("-inf")).exp()
    weights = weights / (weights.sum(-1, keepdim=True) + sinks_h.exp()[None, :, None, None])
    expected = torch.einsum("bhts,bshe->bthe", weights, v.repeat_interleave(H // K, 2))
    torch.testing.assert_close(written, expected, **TOL)
    assert (written - dense_reference(q, k, v, ODD)).abs().max() > 1e-2  # the sinks take weight


def test_rows_of_one_document_take_plain_causal_sdpa():
    docs = torch.stack([torch.full((T,), 3), torch.zeros(T, dtype=torch.long)])
    assert DOCUMENT_CAUSAL.mask(docs, T, CPU) is None
    q, k, v, _ = tensors(2)
    torch.testing.assert_close(DOCUMENT_CAUSAL(q, k, v, None), dense_reference(q, k, v, docs), **TOL)


@pytest.mark.parametrize("scope", ["block", "model"])
def test_a_compiled_model_compiles_once_per_kind_of_layout(scope):
    """`strategies.compile.apply_compile` (both scopes) on CPU: after batches of both kinds (rows of
    one document each, packed rows; each kind after the other, as the whole-model scope resumes its
    frames per transition), new layouts of either kind (other document lengths) run on those graphs:
    no recompile per layout (the packed attention runs outside the graph)."""
    from strategies.compile import apply_compile  # noqa: PLC0415 - the test's subject
    from trainer.models.llama import Llama  # noqa: PLC0415 - the test's subject

    torch._dynamo.reset()
    model = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=T)
    apply_compile(model, backend="eager", scope=scope)
    ids = torch.randint(0, 64, (B, T))
    one_each = torch.zeros(B, T, dtype=torch.long)
    for docs in (one_each, PACKED, one_each):  # each kind, and each after the other
        model(ids, document_ids_bt=docs).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for docs in (ODD, one_each + 5, PACKED, docs_of((64,), (40, 24))):
            model(ids, document_ids_bt=docs).sum().backward()
    torch._dynamo.reset()


def test_ids_that_come_back_use_the_dense_mask():
    """Document 0 resumes after document 1: attention follows the ids, not the runs."""
    docs = torch.tensor([[0] * 20 + [1] * 24 + [0] * 20] * B)
    q, k, v, _ = tensors(3)
    torch.testing.assert_close(
        DOCUMENT_CAUSAL(q, k, v, DOCUMENT_CAUSAL.mask(docs, T, CPU)), dense_reference(q, k, v, docs), **TOL
    )


def test_gqa_saves_no_repeated_keys():
    """enable_gqa: SDPA saves q and its output at the query heads' size, k and v at theirs (no copies)."""
    q, k, v, _ = tensors()
    k.requires_grad_()
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        DOCUMENT_CAUSAL(q, k, v, None)
    assert shapes.count((B, H, T, E)) == 2 and shapes.count((B, K, T, E)) == 2


def test_fused_block_kernels_cuda_calls_on_meta():
    """The CUDA memory-efficient calls of ring attention: argument order and shapes (meta kernels)."""
    Bm, Km, R, Q, S = 2, 4, 2, 24, 20  # Q * R not a multiple of 32: the padded log-sum-exp is cut back
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k, v = torch.empty(Bm, Km, R, Q, E, **meta), torch.empty(Bm, Km, S, E, **meta), torch.empty(Bm, Km, S, E, **meta)
    allowed = torch.ones(Bm, 1, 1, Q, S, dtype=torch.bool, device="meta")
    blocks = FusedBlocks(cuda=True)
    out, lse = blocks.forward(q, k, v, allowed, 0.25)
    assert out.shape == q.shape and lse.shape == (Bm, Km, R, Q) and lse.dtype == torch.float32
    dq, dk, dv = blocks.backward(out, q, k, v, allowed, out, lse, 0.25)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_value_head_dim_may_differ_from_the_query_one():
    # Multi-head latent attention (trainer.models.mla): q/k of 24 features, values of 16.
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(B, T, H, 24, generator=g),
        torch.randn(B, T, H, 24, generator=g),
        torch.randn(B, T, H, 16, generator=g),
    )
    mask = (PACKED[:, :, None] == PACKED[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask[:, None]).transpose(
        1, 2
    )
    torch.testing.assert_close(DOCUMENT_CAUSAL(q, k, v, DOCUMENT_CAUSAL.mask(PACKED, T, CPU)), want, **TOL)
