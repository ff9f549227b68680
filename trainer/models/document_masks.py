"""Document-causal attention over packed rows without a dense ``[T, T]`` mask: the kernels.

A packed row holds several documents; token t attends key s iff ``s <= t`` and both carry the same
document id (Llama Team 2024, "The Llama 3 Herd of Models", section 3.2). A dense boolean mask
rules out the fused causal kernels, computes every pair and makes SDPA save a ``[T, T]`` bias for
backward in every layer. Two exact replacements:

- `PackedDocuments` (CPU, and any device without FlexAttention's backward): the documents of all
  rows, grouped by length into power-of-two buckets and right-padded to the bucket's length, go
  through plain causal SDPA (``is_causal=True``, the fused flash kernel on CPU; GQA through
  ``enable_gqa``), one call per bucket. Right padding cannot change a real token's output under a
  causal mask (the padded keys come after every real query), so the result is exact. Saved memory
  is O(T): at most twice the row's tokens after padding, no ``[T, T]`` tensor; the work is at most
  4x the document-causal pairs, at most ``log2(T) + 1`` calls per layer.
- `document_block_mask` (CUDA): a FlexAttention ``BlockMask`` from a document-causal ``mask_mod``
  (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
  Kernels"): block-sparse, only the blocks that hold allowed pairs are computed.

Shape suffixes: B batch, T sequence length, H query heads, K key/value heads, E head dim,
N documents of a bucket, L a bucket's padded length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    """The documents of a batch, bucketed by length: built once per forward (`pack_documents`).

    Args:
        gather: per bucket, ``[N * L]`` int64 indices into the ``B * T`` flattened tokens: the
            bucket's documents, each right-padded to L by repeating its last token.
        lengths: per bucket, its padded length L.
        order: ``[B * T]`` int64: where each token's output sits in the concatenated bucket outputs.
    """

    gather: tuple[torch.Tensor, ...]
    lengths: tuple[int, ...]
    order: torch.Tensor


def pack_documents(document_ids_bt: torch.Tensor) -> PackedDocuments | None:
    """Buckets the documents (runs of equal ids) of every row by length; None when every row is one.

    A document of n tokens goes to the bucket of length ``min(T, 2**ceil(log2 n))``. Works on the
    ids' device; on CUDA it synchronises (bucket sizes are host numbers), so CUDA uses FlexAttention.
    """
    B, T = document_ids_bt.shape
    starts = torch.nonzero(document_starts(document_ids_bt).flatten()).flatten()
    if starts.numel() == B:
        return None
    n_docs = torch.diff(starts, append=torch.tensor([B * T], device=starts.device))
    bucket_len = torch.clamp(2 ** torch.ceil(torch.log2(n_docs.double())).long(), max=T)
    gather, lengths, real = [], [], []
    for L in sorted(set(bucket_len.tolist())):
        chosen = bucket_len == L
        start_n, len_n = starts[chosen], n_docs[chosen]
        offset_l = torch.arange(L, device=starts.device)
        gather.append((start_n[:, None] + torch.minimum(offset_l[None, :], len_n[:, None] - 1)).flatten())
        real.append((offset_l[None, :] < len_n[:, None]).flatten())
        lengths.append(L)
    gather_all, real_all = torch.cat(gather), torch.cat(real)
    order = torch.empty(B * T, dtype=torch.long, device=starts.device)
    order[gather_all[real_all]] = torch.nonzero(real_all).flatten()
    return PackedDocuments(tuple(gather), tuple(lengths), order)


def packed_document_attention(
    q_bthe: torch.Tensor, k_btke: torch.Tensor, v_btke: torch.Tensor, docs: PackedDocuments
) -> torch.Tensor:
    """Document-causal attention, one causal SDPA call per length bucket: ``[B, T, H, E]``.

    Args:
        q_bthe: queries ``[B, T, H, E]``; k_btke, v_btke: keys and values ``[B, T, K, E]`` (GQA:
            K divides H, query head h served by kv head ``h // (H / K)``).
        docs: the batch's documents (`pack_documents` of its ids).
    """
    B, T, H, E = q_bthe.shape
    flat = [t.reshape(B * T, t.shape[2], E) for t in (q_bthe, k_btke, v_btke)]
    outs = []
    for index, L in zip(docs.gather, docs.lengths):
        q, k, v = (t.index_select(0, index).view(-1, L, t.shape[1], E).transpose(1, 2) for t in flat)
        out_nhle = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        outs.append(out_nhle.transpose(1, 2).reshape(-1, H, E))
    return torch.cat(outs).index_select(0, docs.order).view(B, T, H, E)


def document_block_mask(document_ids_bt: torch.Tensor, *, compiled: bool = True):  # noqa: ANN201
    """FlexAttention ``BlockMask`` of document-causal attention over ``[B, T]`` ids (any ids, on their device).

    ``compiled`` builds it with a compiled kernel (CUDA; the eager build materialises ``[T, T]``
    per row transiently).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids_bt.shape
    docs_bt = document_ids_bt

    def document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (kv_idx <= q_idx) & (docs_bt[b, q_idx] == docs_bt[b, kv_idx])

    return create_block_mask(document_causal, B, None, T, T, device=docs_bt.device, _compile=compiled)


@functools.cache
def _compiled_flex():  # noqa: ANN202
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q_bthe: torch.Tensor, k_btke: torch.Tensor, v_btke: torch.Tensor, block_mask, *, compiled: bool = True  # noqa: ANN001
) -> torch.Tensor:
    """FlexAttention under ``block_mask`` (`document_block_mask`): ``[B, T, H, E]``, GQA through ``enable_gqa``.

    ``compiled`` runs the generated kernel (CUDA); eager Flex is an unfused reference (CPU
    forward only: Flex has no CPU backward in torch 2.13).
    """
    if compiled:
        flex = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    q, k, v = (t.transpose(1, 2) for t in (q_bthe, k_btke, v_btke))
    return flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
