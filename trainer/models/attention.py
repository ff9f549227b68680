"""Grouped-query self-attention with RoPE over packed rows (block-diagonal causal), for `llama.Llama`.

Sources: Su et al. 2021, "RoFormer" (RoPE); Ainslie et al. 2023, "GQA"; Llama Team 2024, "The Llama
3 Herd of Models" (attention kept within each document of a packed sequence); the kernels are in
`trainer.models.document_masks`.

Shape suffixes: B batch, T sequence length, D model dim, H query heads, K key/value heads, E head dim.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.document_masks import (
    PackedDocuments,
    block_causal_mask,
    document_block_mask,
    document_runs_are_contiguous,
    flex_document_attention,
    pack_documents,
    packed_document_attention,
    sink_attention,
)
from trainer.models.norm import ProjectionRMSNorm, RMSNorm

# Where QK-norm normalises: each head's E features (Qwen3) or each projection's heads x E at once (OLMo 2).
QK_NORM_SCOPES = ("head", "projection")


def apply_rope(x_bthe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, heads, E]`` by the angles in ``cos``/``sin``.

    ``cos``/``sin`` are ``[B, T, 1, E/2]`` or ``[1, T, 1, E/2]`` (float32). The
    rotation is done in float32 and the result cast back to ``x``'s dtype.
    """
    x = x_bthe.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x_bthe.dtype)


class DocumentCausalAttention:
    """The one-process attention core: document-causal GQA over packed rows, by device.

    ``mask`` (once per model forward) picks the kernel from the document ids:

    - no ids, or every row one document: plain causal SDPA (``is_causal=True``: flash on CUDA and CPU),
      inside a compiled block's graph;
    - CUDA: FlexAttention with a document-causal ``BlockMask`` (`document_block_mask`), compiled;
    - CPU: causal SDPA per group of equally long documents (`PackedDocuments`, exact, O(T) saved
      memory), outside the compiled graph; ids whose documents are not contiguous runs (never made
      by plait's data) use the dense mask of `block_causal_mask`.

    A compiled block has one graph per kind of mask: the first batch of another kind (the first
    with a document boundary, or the first without) compiles once more, and no later batch does.
    One-document batches keep SDPA inside the graph: routing them through the packed path too
    would avoid that one compile but break every block's graph at every step (measured ~2-4%
    slower per step on the peers' CPU workload, docs/benchmarks.md).

    GQA is SDPA's and Flex's ``enable_gqa`` (no copies of k/v). Context parallelism swaps in
    another core with the same two calls (`Llama.set_attention_core`,
    `strategies.context.attention.ContextParallelAttention`).
    """

    def mask(self, document_ids_bt: torch.Tensor | None, seq_len: int, device: torch.device) -> Any:
        """What the blocks of this forward attend with: None (plain causal), a ``BlockMask``,
        a `PackedDocuments` or a dense ``[B, 1, T, T]`` mask."""
        if document_ids_bt is None:  # traced as is: no graph break without document ids
            return None
        return _document_layout(document_ids_bt)

    def __call__(
        self,
        q_bthe: torch.Tensor,
        k_btke: torch.Tensor,
        v_btke: torch.Tensor,
        mask: Any,
        *,
        sinks_h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, T, H, E]`` queries and ``[B, T, K, E]`` keys/values (after RoPE) -> ``[B, T, H, E]``;
        ``sinks_h`` ``[H]``: attention sinks, written out (`sink_attention`: with a dense mask or
        none, or per group of equally long documents), through Flex with a ``BlockMask``."""
        if sinks_h is not None and (mask is None or isinstance(mask, torch.Tensor)):
            return sink_attention(q_bthe, k_btke, v_btke, mask, sinks_h)
        if isinstance(mask, PackedDocuments):
            return _packed(q_bthe, k_btke, v_btke, mask, sinks_h=sinks_h)
        if sinks_h is not None:  # CUDA's document BlockMask (its packed rows)
            return flex_document_attention(q_bthe, k_btke, v_btke, mask, sinks_h=sinks_h)
        if mask is not None and not isinstance(mask, torch.Tensor):
            return flex_document_attention(q_bthe, k_btke, v_btke, mask)
        q_bhte, k_bkte, v_bkte = (t.transpose(1, 2) for t in (q_bthe, k_btke, v_btke))
        out_bhte = F.scaled_dot_product_attention(
            q_bhte, k_bkte, v_bkte, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        return out_bhte.transpose(1, 2)


# Outside any compiled region (a whole-model compile): the layout is read from the ids' values,
# which traced code would turn into guards and recompile on when the layout changes.
@torch.compiler.disable
def _document_layout(document_ids_bt: torch.Tensor) -> Any:
    """`DocumentCausalAttention.mask` for given ids: a ``BlockMask`` on CUDA, else a `PackedDocuments`
    (a dense mask for ids whose documents are not contiguous runs)."""
    if document_ids_bt.device.type == "cuda":
        return document_block_mask(document_ids_bt)
    if not document_runs_are_contiguous(document_ids_bt):
        return block_causal_mask(document_ids_bt)
    return pack_documents(document_ids_bt)


# The document layout changes with every batch: run it outside the compiled block (a graph break
# around one fused call) instead of recompiling the block for each new layout.
_packed = torch.compiler.disable(packed_document_attention)

DOCUMENT_CAUSAL = DocumentCausalAttention()


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; the attention itself is ``self.core`` (`DocumentCausalAttention` by default).

    Each of the ``n_kv_heads`` key/value heads serves ``n_heads // n_kv_heads``
    consecutive query heads (kv head j serves query heads j*r .. j*r + r - 1). ``head_dim`` E
    defaults to ``dim // n_heads``; ``qkv_bias`` adds biases to the q/k/v projections (Qwen2);
    ``qk_norm`` RMS-normalises q and k before RoPE (eps ``norm_eps``): each head with
    ``qk_norm_scope="head"`` (Qwen3), the whole projection with ``"projection"`` (OLMo 2). ``rope=False``
    leaves q and k unrotated (a NoPE layer: SmolLM3). ``query_pre_attn_scalar`` s scales the scores
    by ``1 / sqrt(s)`` instead of ``1 / sqrt(E)`` (Gemma 3); ``norm_unit_offset``: Gemma's
    ``1 + weight`` QK-norms. ``sinks``: a learned sink logit per query head, ``sinks`` ``[H]``
    (`sink_attention`); ``o_bias``: a bias on the output projection (both GPT-OSS).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_scope: str = "head",
        norm_eps: float = 1e-6,
        rope: bool = True,
        query_pre_attn_scalar: float | None = None,
        norm_unit_offset: bool = False,
        sinks: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=o_bias)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        # QK-norm before RoPE: of each query and key head over its E features (Qwen3), or of each
        # projection over all its heads' features (OLMo 2), which ties the heads together.
        if qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope={qk_norm_scope!r} is not one of {', '.join(QK_NORM_SCOPES)}")
        self.qk_norm_scope = qk_norm_scope if qk_norm else None
        offset = {"unit_offset": norm_unit_offset}
        if self.qk_norm_scope == "projection":
            self.q_norm = ProjectionRMSNorm(n_heads * self.head_dim, norm_eps, **offset)
            self.k_norm = ProjectionRMSNorm(n_kv_heads * self.head_dim, norm_eps, **offset)
        else:
            self.q_norm = RMSNorm(self.head_dim, norm_eps, **offset) if qk_norm else None
            self.k_norm = RMSNorm(self.head_dim, norm_eps, **offset) if qk_norm else None
        self.rope = rope
        # The cores scale scores by 1/sqrt(E): a factor on q turns that into 1/sqrt(s).
        self.q_scale = None if query_pre_attn_scalar is None else math.sqrt(self.head_dim / query_pre_attn_scalar)
        # The attention computation proper (q, k, v -> output); context parallelism replaces it.
        self.core: Any = DOCUMENT_CAUSAL

    def forward(self, x_btd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
        """``x`` ``[B, T, D]`` -> ``[B, T, D]``; ``mask`` is what ``self.core.mask`` built for this forward."""
        B, T, _ = x_btd.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp and n_kv_heads/tp of them.
        q_btf, k_btf = self.wq(x_btd), self.wk(x_btd)
        if self.qk_norm_scope == "projection":
            q_btf, k_btf = self.q_norm(q_btf), self.k_norm(k_btf)
        q_bthe = q_btf.view(B, T, -1, self.head_dim)
        k_btke = k_btf.view(B, T, -1, self.head_dim)
        v_btke = self.wv(x_btd).view(B, T, -1, self.head_dim)
        if self.qk_norm_scope == "head":
            q_bthe, k_btke = self.q_norm(q_bthe), self.k_norm(k_btke)
        if self.rope:
            q_bthe = apply_rope(q_bthe, cos, sin)
            k_btke = apply_rope(k_btke, cos, sin)
        if self.q_scale is not None and self.q_scale != 1.0:
            q_bthe = q_bthe * self.q_scale

        if self.sinks is None:
            out_bthe = self.core(q_bthe, k_btke, v_btke, mask)
        else:  # under tensor parallelism a DTensor sharded by head: this rank's heads
            sinks_h = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
            out_bthe = self.core(q_bthe, k_btke, v_btke, mask, sinks_h=sinks_h)
        out_btd = out_bthe.reshape(B, T, -1)
        return self.wo(out_btd)


def sliding_window_mask(
    document_ids_bt: torch.Tensor | None, seq_len: int, window: int, device: torch.device
) -> torch.Tensor:
    """Dense boolean mask ``[B or 1, 1, T, T]`` of causal attention within ``window`` tokens (Gemma 3's
    and Mistral's sliding window, as transformers applies it): query t sees key s iff
    ``t - window < s <= t`` and, with ``document_ids_bt``, both are in the same document.

    Dense (O(T^2)): a windowed layer runs SDPA with this mask on every device.
    """
    t_t = torch.arange(seq_len, device=device)
    distance_tt = t_t[:, None] - t_t[None, :]
    allowed_tt = (distance_tt >= 0) & (distance_tt < window)
    if document_ids_bt is None:
        return allowed_tt[None, None]
    same_btt = document_ids_bt[:, :, None] == document_ids_bt[:, None, :]
    return (allowed_tt[None] & same_btt)[:, None]
