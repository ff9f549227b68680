"""Saved-for-backward bytes of one block of a micro-batch (`layer_activation_bytes`), by op.

Sources: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(activation bytes per layer under tensor and sequence parallelism).

Activations are the tensors autograd saves for backward in plait's Llama (trainer/models/llama.py,
attention.py, document_masks.py), counted op by op per token and layer: RMSNorm keeps its fp32
input, normalised input and 1/rms; every projection its input; attention q, k, v (at their own
heads: GQA through ``enable_gqa``), output and log-sum-exp, with no mask (document-causal kernels;
on CPU one pair of int64 token indices per forward); SwiGLU its two
projections, the SiLU output and the product; the head the log-softmax output (fp32). Sequence
parallel shards the norms' tensors by tp, heads and ffn features are sharded by tp, context
parallel shards every token-wise tensor by cp (ring attention keeps no mask and copies its output
once more). Full activation checkpointing keeps the block input only. QK-norm (Qwen3 per head,
OLMo 2 per projection) keeps the same three tensors over q's and k's features; a post-norm block
(OLMo 2) saves what a pre-norm one does (its norms take the sublayers' outputs, its projections
the block input), so it needs no term of its own.

LoRA's adapters add A's output (r features a token; `adapter_bytes_per_token`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strategies.core.shape import ModelShape
from strategies.planner.layout import Layout, Workload


def layer_activation_bytes(
    shape: ModelShape, layout: Layout, work: Workload, tokens: int, *, device: str, layer: int | None = None
) -> int:
    """Saved-for-backward bytes of one block (no checkpointing) for ``tokens`` tokens of a micro-batch
    on this rank (b x seq_len / cp); block ``layer`` (None: a dense one) may be a mixture of experts."""
    a, d, f = work.act_bytes, shape.dim, shape.ffn_dim
    tp = layout.tp
    sp = tp if layout.sequence_parallel and tp > 1 else 1
    heads, e = shape.n_heads // tp, shape.head_dim
    ring = layout.cp > 1
    kv_heads = shape.n_kv_heads // tp  # GQA through enable_gqa: k and v are saved at their own heads
    norms = block_norms(shape, layer) * (2 * d + 1) * 4  # x (fp32), x/rms (fp32), 1/rms, for each norm
    per_token = norms / sp + 2 * d * a  # + the two norm outputs, gathered (projection inputs)
    if shape.latent_attention:  # whole on every tp rank (trainer.models.moe_transformer's tp plan)
        per_token += latent_attention_bytes_per_token(
            shape.n_heads, shape.latent_attention, a, device=device, rows=work.seq_len
        )
    else:
        per_token += (2 * heads + 2 * kv_heads) * e * a + heads * 4  # q, k, v, out; log-sum-exp (fp32)
    if ring:
        per_token += heads * e * a  # the attention output copied into the wo input
    per_token += qk_norm_bytes_per_token(shape, layer, tp)
    if layer is not None:
        per_token += adapter_bytes_per_token(shape, layout, work, layer)
    if shape.attention_sinks:
        per_token += sink_attention_extra_bytes_per_token(shape, layer, work, heads, kv_heads)
    if layer in shape.window_layers and work.seq_len > shape.sliding_window:
        per_token += work.seq_len * 4  # SDPA's additive fp32 copy of the window mask, [B, 1, T, T]
    if layer is not None and shape.is_moe(layer):
        per_token += moe_activation_bytes_per_token(shape, a)
        if shape.expert_activation == "clamped_swiglu":  # g, u, clamped g, sigmoid, up + 1, glu, h: 7 F
            per_token += shape.top_k * (3 * shape.moe_ffn_dim * a + 8)  # + each row's expert id (biases)
    else:
        per_token += 4 * (f // tp // layout.ist_islands) * a  # w1 and w3 outputs, SiLU output, their product
    return int(tokens * per_token)


def adapter_bytes_per_token(shape: ModelShape, layout: Layout, work: Workload, layer: int | None) -> float:
    """Saved bytes per token of LoRA's adapters on the linear layers of block ``layer`` (None: the
    output head): B keeps A's output, r features in the compute dtype (a row-wise layer's reduced
    onto the sequence shards under sequence parallelism); with dropout > 0 A keeps the dropped-out
    input (in features) and dropout its boolean mask (LoRA refuses dropout under tp). A's own input
    is the base layer's, counted with it. 0 without LoRA."""
    lora = work.lora
    if lora is None:
        return 0.0
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    total = 0.0
    for p in filter(lora.adapts, shape.params_of_layer.get(layer, ())):
        total += lora.rank * work.act_bytes / (sp if p.tp_dim == 1 else 1)
        if lora.dropout > 0:
            total += p.shape[1] * (work.act_bytes + 1)
    return total


def block_norms(shape: ModelShape, layer: int | None) -> int:
    """RMSNorms of block ``layer`` around its sublayers, read off their weights: 2 in a pre-norm
    or post-norm block, 4 in a sandwich (Gemma 3); 2 when the names are not plait's."""
    names = [
        f"layers.{layer}.{n}.weight" for n in ("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm")
    ]
    return sum(p.name in names for p in shape.params_of_layer.get(layer, ())) or 2


def qk_norm_bytes_per_token(shape: ModelShape, layer: int | None, tp: int) -> int:
    """Saved bytes per token of block ``layer``'s QK-norms (``attention.{q,k}_norm`` after
    ``attention.{wq,wk}``), read off their weights: each keeps its fp32 input and normalised output
    (the projection's features on this rank) and one fp32 1/rms per normalised row: per head for a
    head-wise norm (Qwen3), one per token for a projection-wide one (OLMo 2, whose rows span the
    tp ranks). None (a dense block of unknown index) or no such norm: 0."""
    specs = {p.name.removeprefix(f"layers.{layer}.attention."): p.shape for p in shape.params_of_layer.get(layer, ())}
    total = 0
    for proj, norm in (("wq", "q_norm"), ("wk", "k_norm")):
        if f"{norm}.weight" in specs and f"{proj}.weight" in specs:
            features = specs[f"{proj}.weight"][0] // tp
            rows = max(1, features // specs[f"{norm}.weight"][0])
            total += (2 * features + rows) * 4
    return total


def latent_attention_bytes_per_token(n_heads: int, mla: Mapping[str, Any], a: int, *, device: str, rows: int) -> int:
    """Saved bytes per token of multi-head latent attention (`trainer.models.mla`; its input is
    counted with the block's norm outputs, and RoPE by a table saves none of q or k): the query
    latent and its norm (fp32 input and normalised copy, 1/rms, output), the key/value latent
    projection's [c + r] storage, its norm and output; then the attention. Its values are
    narrower than its keys, so on CPU SDPA runs its math kernel, which copies q, k and v per head
    and keeps each row's probabilities (``rows`` keys: the row length, an upper bound for packed
    documents) besides the output; elsewhere the kernel keeps q, k, the up-projection's storage
    that v views, the output and the log-sum-exp (fp32)."""
    h, qr, c, r = n_heads, mla["q_lora_rank"], mla["kv_lora_rank"], mla["qk_rope_head_dim"]
    n, v = mla["qk_nope_head_dim"], mla["v_head_dim"]
    qk = n + r
    total = ((2 * qr + 1) * 4 + qr * a) if qr else 0
    # kv_norm's fp32 input: in fp32 a view of the projection's [c + r] storage, else its own copy
    total += (c + r) * 4 if a == 4 else c * 4
    total += (c + 1) * 4 + c * a
    if device == "cpu":
        return total + h * (2 * qk + 2 * v) * a + h * rows * a
    return total + 2 * h * qk * a + h * (n + v) * a + h * v * a + h * 4


def moe_activation_bytes_per_token(shape: ModelShape, a: int) -> float:
    """Saved bytes per token of an MoE feed-forward (`trainer.models.moe.MoE`, replicated over tp;
    its input is the norm output counted with the attention's), as its ``[N, ...]`` tensors are:
    each of the top_k copies of a token saves its gathered input and expert output rows (2 D),
    the SwiGLU intermediates (4 F) and its index, order and weight (32 bytes); the shared experts
    save 4 F each; the router its scores and logits (fp32, 2 E) and per-token sums (12 bytes).
    Under expert parallelism a rank's rows are top_k x tokens only in the mean (balanced routing)."""
    d, f = shape.dim, shape.moe_ffn_dim
    routed = shape.top_k * (2 * d * a + 4 * f * a + 32)
    return routed + shape.num_shared_experts * 4 * f * a + 8 * shape.num_experts + 12


def sink_attention_extra_bytes_per_token(
    shape: ModelShape, layer: int | None, work: Workload, heads: int, kv_heads: int
) -> int:
    """Saved bytes per token of GPT-OSS's written-out attention with sinks (`trainer.models.attention.
    sink_attention`) beyond SDPA's: k and v repeated to every query head (fp32) instead of at their own
    heads, q in fp32 (a copy unless the activations are fp32), the fp32 probabilities over the keys
    and the sink, and the boolean mask's complement ([B, 1, T, T] with document masks or a window);
    no log-sum-exp, and no additive fp32 copy of a window mask."""
    a, e, t = work.act_bytes, shape.head_dim, work.seq_len
    windowed = layer in shape.window_layers and t > shape.sliding_window
    sdpa = 2 * kv_heads * e * a + heads * 4 + (t * 4 if windowed else 0)
    sinks = 2 * heads * e * 4 + (heads * e * 4 if a != 4 else 0) + heads * (t + 1) * 4
    return sinks + (t if work.document_masks or windowed else 0) - sdpa
