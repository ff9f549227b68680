"""Document-causal attention over packed rows without a dense ``[T, T]`` mask: the kernels.

A packed row holds several documents; token t attends key s iff ``s <= t`` and both carry the same
document id (Llama Team 2024, "The Llama 3 Herd of Models", section 3.2). A dense boolean mask
rules out the fused causal kernels, computes every pair and makes SDPA save a ``[T, T]`` bias for
backward in every layer. Two exact replacements:

- `PackedDocuments` (CPU, and any device without FlexAttention's backward): the documents of all
  rows, grouped by length, go through plain causal SDPA (``is_causal=True``, the fused flash kernel
  on CPU; GQA through ``enable_gqa``), one call per distinct length (at most ``sqrt(2 B T)``).
  Exact, no padding: SDPA saves q, k, v, the output and the log-sum-exp of each token, as for an
  unpacked row; no ``[T, T]`` tensor, and only the document-causal pairs are computed.
- `document_block_mask` (CUDA): a FlexAttention ``BlockMask`` from a document-causal ``mask_mod``
  (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
  Kernels"): block-sparse, only the blocks that hold allowed pairs are computed.

Shape suffixes: B batch, T sequence length, H query heads, K key/value heads, E head dim,
N documents of a group, L their length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention


def block_causal_mask(document_ids_bt: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, T, T]``: True where query t may attend key s.

    Token t attends s iff ``s <= t`` and ``document_ids[s] == document_ids[t]``. Only for ids
    whose documents are not contiguous runs (see `document_runs_are_contiguous`), never built for
    plait's packed rows.
    """
    T = document_ids_bt.shape[-1]
    causal_tt = torch.ones(T, T, dtype=torch.bool, device=document_ids_bt.device).tril()
    same_doc_btt = document_ids_bt[:, :, None] == document_ids_bt[:, None, :]
    return (same_doc_btt & causal_tt)[:, None, :, :]


def document_starts(document_ids_bt: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, T]``: True where a run of equal ids begins (position 0 of every row included)."""
    starts_bt = torch.ones_like(document_ids_bt, dtype=torch.bool)
    starts_bt[:, 1:] = document_ids_bt[:, 1:] != document_ids_bt[:, :-1]
    return starts_bt


def document_runs_are_contiguous(document_ids_bt: torch.Tensor) -> bool:
    """Whether every document of every row is one run of tokens (no id comes back after another).

    Plait's packing, preference rows and generation prompts all are; a run then is a document.
    Synchronises with the device of the ids (call it on CPU ids).
    """
    runs = int(document_starts(document_ids_bt).sum())
    sorted_bt = document_ids_bt.sort(dim=1).values
    return runs == int(document_starts(sorted_bt).sum())


@dataclass(frozen=True)
class PackedDocuments:
    """The documents of a batch, grouped by length: built once per forward (`pack_documents`).

    Args:
        gather: per group, ``[N * L]`` int64 indices into the ``B * T`` flattened tokens: the
            group's N documents of L tokens each, in order.
        lengths: per group, its document length L.
        order: ``[B * T]`` int64: where each token's output sits in the concatenated group outputs.
    """

    gather: tuple[torch.Tensor, ...]
    lengths: tuple[int, ...]
    order: torch.Tensor


def pack_documents(document_ids_bt: torch.Tensor) -> PackedDocuments | None:
    """Groups the documents (runs of equal ids) of every row by length; None when every row is one.

    Works on the ids' device; on CUDA it synchronises (group sizes are host numbers), so CUDA uses
    FlexAttention instead.
    """
    B, T = document_ids_bt.shape
    starts = torch.nonzero(document_starts(document_ids_bt).flatten()).flatten()
    if starts.numel() == B:
        return None
    n_docs = torch.diff(starts, append=torch.tensor([B * T], device=starts.device))
    gather, lengths = [], []
    for L in torch.unique(n_docs).tolist():
        gather.append((starts[n_docs == L][:, None] + torch.arange(L, device=starts.device)).flatten())
        lengths.append(L)
    gather_all = torch.cat(gather)
    order = torch.empty_like(gather_all)
    order[gather_all] = torch.arange(B * T, device=starts.device)
    return PackedDocuments(tuple(gather), tuple(lengths), order)


def sink_attention(
    q_bthe: torch.Tensor,
    k_btke: torch.Tensor,
    v_btke: torch.Tensor,
    allowed: torch.Tensor | None,
    sinks_h: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention with a learned sink logit per query head (GPT-OSS): ``[B, T, H, E]``.

    Each head's softmax denominator gets ``exp(sinks_h[h])`` beside its keys' terms, so a query
    may give less than all of its weight to the keys (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b
    Model Card"; Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").
    Written out (transformers' ``eager_attention_forward`` of GPT-OSS): no fused kernel takes an
    extra denominator term, so the scores ``[B, H, T, S]`` are materialised, in float32.

    Args:
        q_bthe: queries ``[B, T, H, E]``; k_btke, v_btke: keys and values ``[B, S, K, E]`` (K divides H).
        allowed: boolean ``[B or 1, 1, T, S]`` (True: query t sees key s); None: causal (T == S).
        sinks_h: ``[H]`` sink logits (this rank's heads under tensor parallelism).
    """
    H, K, E = q_bthe.shape[2], k_btke.shape[2], q_bthe.shape[-1]
    q_bhte = q_bthe.transpose(1, 2).float()
    k_bhse, v_bhse = (t.transpose(1, 2).float().repeat_interleave(H // K, dim=1) for t in (k_btke, v_btke))
    scores_bhts = (q_bhte @ k_bhse.transpose(-2, -1)) * E**-0.5
    if allowed is None:
        T, S = scores_bhts.shape[-2:]
        allowed = torch.ones(T, S, dtype=torch.bool, device=q_bthe.device).tril(S - T)
    scores_bhts = scores_bhts.masked_fill(~allowed, float("-inf"))
    sinks_bht1 = sinks_h.float().view(1, -1, 1, 1).expand(*scores_bhts.shape[:-1], 1)
    probs_bhts = torch.cat([scores_bhts, sinks_bht1], dim=-1).softmax(-1)[..., :-1]
    return (probs_bhts @ v_bhse).to(q_bthe.dtype).transpose(1, 2)


def packed_document_attention(
    q_bthe: torch.Tensor,
    k_btke: torch.Tensor,
    v_btke: torch.Tensor,
    docs: PackedDocuments,
    *,
    sinks_h: torch.Tensor | None = None,
) -> torch.Tensor:
    """Document-causal attention, one causal SDPA call per document length: ``[B, T, H, E]``.

    Args:
        q_bthe: queries ``[B, T, H, E]``; k_btke, v_btke: keys and values ``[B, T, K, E]`` (GQA:
            K divides H, query head h served by kv head ``h // (H / K)``); the values' head dim
            may differ from E (the output then has it).
        docs: the batch's documents (`pack_documents` of its ids).
        sinks_h: ``[H]`` attention sinks (GPT-OSS): each group through `sink_attention`, causal,
            its scores ``[N, H, L, L]`` written out (O(sum of L^2), not O(T^2)); None: SDPA.
    """
    B, T, H, _ = q_bthe.shape
    Ev = v_btke.shape[-1]  # the value head dim may differ from the query/key one (latent attention)
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q_bthe, k_btke, v_btke)]
    outs = []
    for index, L in zip(docs.gather, docs.lengths):
        q, k, v = (t.index_select(0, index).view(-1, L, *t.shape[1:]).transpose(1, 2) for t in flat)
        if sinks_h is None:
            out_nhle = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # sink_attention takes [N, L, heads, E]
            out_nhle = sink_attention(*(t.transpose(1, 2) for t in (q, k, v)), None, sinks_h).transpose(1, 2)
        outs.append(out_nhle.transpose(1, 2).reshape(-1, H, Ev))
    return torch.cat(outs).index_select(0, docs.order).view(B, T, H, Ev)


def document_block_mask(document_ids_bt: torch.Tensor, *, compiled: bool = True):  # noqa: ANN201
    """FlexAttention ``BlockMask`` of document-causal attention over ``[B, T]`` ids (any ids, on their device).

    ``compiled`` builds it with a compiled kernel (CUDA; the eager build materialises ``[T, T]``
    per row transiently).
    """
    B, T = document_ids_bt.shape
    docs_bt = document_ids_bt

    def document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (kv_idx <= q_idx) & (docs_bt[b, q_idx] == docs_bt[b, kv_idx])

    return create_block_mask(document_causal, B, None, T, T, device=docs_bt.device, _compile=compiled)


@functools.cache
def _compiled_flex():  # noqa: ANN202
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q_bthe: torch.Tensor,
    k_btke: torch.Tensor,
    v_btke: torch.Tensor,
    block_mask,
    *,
    compiled: bool = True,  # noqa: ANN001
    sinks_h: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention under ``block_mask`` (`document_block_mask`): ``[B, T, H, E]``, GQA through ``enable_gqa``.

    ``compiled`` runs the generated kernel (CUDA); eager Flex is an unfused reference (CPU
    forward only: Flex has no CPU backward in torch 2.13). ``sinks_h`` ``[H]``: GPT-OSS's attention
    sinks, a term ``exp(sink)`` in each softmax's denominator, applied to the output as
    ``sigmoid(lse - sink)`` (``lse`` the keys' log-sum-exp, which Flex returns and differentiates).
    """
    if compiled:
        flex = _compiled_flex()
    else:
        flex = flex_attention
    q, k, v = (t.transpose(1, 2) for t in (q_bthe, k_btke, v_btke))
    if sinks_h is None:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
    out_bhte, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    kept_bht = torch.sigmoid(aux.lse.float() - sinks_h.float()[None, :, None])
    return (out_bhte.float() * kept_bht[..., None]).to(out_bhte.dtype).transpose(1, 2)
