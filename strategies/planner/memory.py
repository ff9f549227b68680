"""Per-rank memory of one layout: parameters, gradients, optimizer state, activations, transients.

Sources: Rajbhandari et al. 2020, "ZeRO" (states by sharding degree); Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (activation bytes per layer under
tensor and sequence parallelism, full recomputation keeps block inputs); Narayanan et al. 2021
(micro-batches in flight per pipeline schedule); Mist (Zhu et al. 2025, EuroSys) for predicting
memory symbolically per layout before launch.

Parameters, gradients and optimizer state are counted tensor by tensor, as the strategies lay them
out: tensor parallelism splits the dim the model's ``tp_plan`` names, then FSDP2 chunks dim 0 of the
result over dp_shard x cp ranks (``torch.chunk``, padded to equal chunks in its storage), pipeline
parallelism keeps the stages of one pp rank. Optimizer states are ``zeros_like`` the (unpadded)
local shard, plus Adam's 4-byte ``step`` per tensor. These three match the storages a rank holds
exactly (`strategies.planner.measure`).

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

LoRA (``Workload.lora``, `strategies.transforms.lora`) freezes every parameter: the base keeps its
parameters (sharded as above) but no gradients and no optimizer state; each adapted weight [out, in]
gains A [r, in] and B [out, r] in its dtype, trained (`kept_tensors`). QLoRA
(`strategies.transforms.qlora`) keeps each adapted weight as NF4 codes, 4 bits a weight in float32
storage that FSDP2 shards, plus its quantisation state whole on every rank (a float32 absmax per
64 weights and a 64-byte code book). The adapters add A's output (r features a token) to the
saved activations (`adapter_bytes_per_token`). A frozen base also lets autograd drop tensors kept
only for weight gradients (a frozen layer's input where no adapter reads it, the norms' normalised
input, the token ids); these are still counted, so LoRA's activations are an upper bound.

Independent Subnet Training (``Layout.ist_islands`` = P > 1) keeps 1 / P of every dense MLP's
hidden units on each rank during a round: its gate/up rows, down columns, their gradients,
optimizer state and SwiGLU activations. At a reassembly (no gradients, no activations) a rank
briefly holds, besides its narrow MLPs, one flat copy of them, the P messages received and the
full tensors built from those: (1 + 2P) x its narrow MLP parameters and optimizer state, counted
as the transient when it exceeds the step's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from strategies.core.shape import ModelShape, ParamSpec
from strategies.muon import ADAMW_PARAMS, takes_muon
from strategies.planner.layout import MUON_MATRIX_STATES, OPTIMIZER_STATES, Layout, LoRASpec, Workload
from strategies.planner.ranks import (
    checkpointed_layers,
    local_numel,
    rank_coords,
    rank_of,
    rank_param_counts,
    rank_params,
    stage_plan,
)
from strategies.transforms.qlora import BLOCKSIZE, STORAGE

GiB = 1024**3


@dataclass
class MemoryBreakdown:
    """Predicted bytes on one rank.

    Attributes:
        params, grads, optimizer: training state (exact).
        activations_per_microbatch: saved-for-backward bytes of one micro-batch through this
            rank's stages (block inputs only for checkpointed blocks).
        inflight: micro-batches whose activations are alive at once under the pipeline schedule.
        transient: peak extra during a step (FSDP's gathered blocks and root, logits and their
            gradient, one recomputed block).
    """

    params: int
    grads: int
    optimizer: int
    activations_per_microbatch: int
    inflight: float
    transient: int

    @property
    def activations(self) -> int:
        return int(self.activations_per_microbatch * self.inflight)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "activations": self.activations, "total": self.total}

    def describe(self) -> str:
        parts = [
            ("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
            (f"activations ({self.inflight:g} micro-batches)", self.activations), ("transient", self.transient),
        ]  # fmt: skip
        return ", ".join(f"{name} {b / GiB:.2f}" for name, b in parts) + f"; total {self.total / GiB:.2f} GiB"


# ---------------------------------------------------------------------------------- states
def state_bytes(shape: ModelShape, layout: Layout, work: Workload, rank: int) -> tuple[int, int, int]:
    """Exact (params, grads, optimizer) bytes of one global rank.

    Gradients live in FSDP2's padded reduce-scatter buffers (or, without FSDP, tensors shaped like
    the parameters; a vocabulary-sharded embedding's gradient is whole on every tp rank, see
    `ParamSpec`); optimizer states are ``zeros_like`` the unpadded shard, and so are the tensors a
    local-SGD algorithm keeps beside them (``Layout.replica_kept`` of them: DiLoCo's anchors and
    outer momentum), counted with the optimizer's. Only trained tensors have gradients and
    optimizer state: under LoRA the adapters, not the frozen base (`kept_tensors`); the params
    include QLoRA's quantisation state (``Kept.whole``), which is not a parameter.
    """
    c = rank_coords(layout, rank)
    shard_index = c["dp_shard"] * layout.cp + c["cp"]
    params = grads = optim = 0
    for p, count, trained, itemsize, _, whole_bytes in kept_tensors(shape, layout, work, c["pp"]):
        numel, padded = local_numel(p, layout, shard_index)
        if is_ist_unit(p, shape, layout):
            numel, padded = numel // layout.ist_islands, padded // layout.ist_islands
        params += count * (padded * itemsize + whole_bytes)
        if not trained:
            continue
        whole = p.grad_tp_replicated and layout.tp > 1 and not layout.uses_fsdp
        grads += count * (math.prod(p.shape) if whole else padded) * work.param_bytes
        muon = work.optimizer == "muon" and takes_muon(p.name, len(p.shape), work.adamw_params)
        n_states, has_step = MUON_MATRIX_STATES if muon else OPTIMIZER_STATES[work.optimizer]
        optim += count * (n_states * numel * work.param_bytes + (4 if has_step else 0))
    return params, grads, optim + local_sgd_bytes(shape, layout, work, rank)


class Kept(NamedTuple):
    """One parameter tensor as a rank keeps it (`kept_tensors`).

    Attributes:
        spec: its name, full shape (QLoRA's codes: their packed storage's), tp dim and block.
        count: alike tensors it stands for (alike blocks counted once, `rank_param_counts`).
        trained: it has a gradient and optimizer state (under LoRA only the adapters do).
        itemsize: bytes per element as kept (``Workload.param_bytes``; QLoRA's codes: ``STORAGE``'s).
        cast: FSDP gathers it in the compute dtype; False for QLoRA's codes, gathered as they are
            (`strategies.fsdp.FSDP.shard_module` with ``cast=False``).
        whole: bytes kept beside it whole on every rank, whatever the sharding: QLoRA's quantisation
            state (`nf4_state_bytes`), on the module, not a parameter.
    """

    spec: ParamSpec
    count: int
    trained: bool
    itemsize: int
    cast: bool = True
    whole: int = 0


def kept_tensors(shape: ModelShape, layout: Layout, work: Workload, pp_rank: int) -> list[Kept]:
    """The parameter tensors of a pp rank (`rank_params`) as the run keeps them.

    Without LoRA every tensor trains, in ``Workload.param_bytes``. LoRA (``Workload.lora``,
    `strategies.transforms.lora.apply_lora`) freezes every parameter and gives each adapted weight
    [out, in] two trained adapters of its dtype (`adapter_specs`); QLoRA stores that weight as
    NF4 codes (`nf4_codes`) with its quantisation state. Alike blocks count once
    (`rank_param_counts`) unless a name decides per tensor (LoRA's targets may name single blocks,
    ``layers.0.*``; so may a custom Muon split, ``Workload.adamw_params``): then each tensor once.
    """
    lora, pb = work.lora, work.param_bytes
    by_kind = lora is None and (work.optimizer != "muon" or work.adamw_params == ADAMW_PARAMS)
    pairs = (
        rank_param_counts(shape, layout, pp_rank) if by_kind else [(p, 1) for p in rank_params(shape, layout, pp_rank)]
    )
    if lora is None:
        return [Kept(p, n, True, pb) for p, n in pairs]
    out = []
    for p, n in pairs:
        if not lora.adapts(p):
            out.append(Kept(p, n, False, pb))
            continue
        if lora.quantize is None:
            out.append(Kept(p, n, False, pb))
        else:
            out.append(Kept(nf4_codes(p), n, False, STORAGE.itemsize, cast=False, whole=nf4_state_bytes(p)))
        out += [Kept(a, n, True, pb) for a in adapter_specs(p, lora)]
    return out


def adapter_specs(p: ParamSpec, lora: LoRASpec) -> tuple[ParamSpec, ParamSpec]:
    """LoRA's A [r, in] and B [out, r] of an adapted weight ``p`` [out, in], sharded by tensor
    parallelism as `strategies.transforms.lora` places them: a column-wise weight (tp dim 0) keeps A
    whole and shards B's rows, a row-wise one (tp dim 1) shards A's columns and keeps B whole."""
    layer, (out, features) = p.name.removesuffix(".weight"), p.shape
    a = ParamSpec(f"{layer}.lora_A.weight", (lora.rank, features), 1 if p.tp_dim == 1 else None, p.layer)
    b = ParamSpec(f"{layer}.lora_B.weight", (out, lora.rank), 0 if p.tp_dim == 0 else None, p.layer)
    return a, b


def nf4_codes(p: ParamSpec) -> ParamSpec:
    """The parameter QLoRA keeps for weight ``p`` (`strategies.transforms.qlora.NF4Linear`): its n
    weights as 4-bit codes, two a byte, in ``STORAGE`` elements: bitsandbytes' ``quantize_4bit``
    returns [(n + 1) // (2 x itemsize), 1] (float32: n / 8 elements, n / 2 bytes). FSDP2 shards
    them like any parameter; QLoRA refuses tensor parallelism."""
    n = math.prod(p.shape)
    return ParamSpec(p.name, ((n + 1) // (2 * STORAGE.itemsize), 1), None, p.layer)


def nf4_state_bytes(p: ParamSpec) -> int:
    """Bytes of the quantisation state QLoRA keeps for weight ``p`` on its module (a bitsandbytes
    ``QuantState``, whole on every rank): one float32 absmax per ``BLOCKSIZE`` weights (no double
    quantisation: ``compress_statistics=False``) and the 16-entry float32 NF4 code book."""
    return 4 * -(-math.prod(p.shape) // BLOCKSIZE) + 16 * 4


def local_sgd_bytes(shape: ModelShape, layout: Layout, work: Workload, rank: int) -> int:
    """Bytes of the parameter-sized tensors a local-SGD algorithm keeps on one global rank
    (``Layout.replica_kept`` unpadded shards: DiLoCo's anchors and outer momentum); 0 without one."""
    if not layout.replica_kept:
        return 0
    c = rank_coords(layout, rank)
    shard_index = c["dp_shard"] * layout.cp + c["cp"]
    numel = 0
    for p, count in rank_param_counts(shape, layout, c["pp"]):
        n, padded = local_numel(p, layout, shard_index)
        numel += count * (n // layout.ist_islands if is_ist_unit(p, shape, layout) else n)
    return round(layout.replica_kept * numel * work.param_bytes)


def is_ist_unit(p: ParamSpec, shape: ModelShape, layout: Layout) -> bool:
    """Whether ``p`` is indexed by the hidden units IST splits: a dense block's gate/up weight or bias, or its down weight."""
    if layout.ist_islands == 1 or p.layer is None or shape.is_moe(p.layer):
        return False
    return p.name.endswith(("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight",
                            "feed_forward.w1.bias", "feed_forward.w3.bias"))  # fmt: skip


def ist_reassembly_extra(shape: ModelShape, layout: Layout, work: Workload) -> int:
    """Bytes a rank adds at an IST reassembly to its narrow state: (1 + 2P) x its narrow MLP
    parameters and optimizer state (see the module docstring)."""
    n_states, _ = OPTIMIZER_STATES[work.optimizer]
    narrow = sum(math.prod(p.shape) // layout.ist_islands for p in shape.params if is_ist_unit(p, shape, layout))
    return (1 + 2 * layout.ist_islands) * narrow * (1 + n_states) * work.param_bytes


# ---------------------------------------------------------------------------------- activations
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


def stage_activation_bytes(
    shape: ModelShape,
    layout: Layout,
    work: Workload,
    *,
    layers: range,
    first: bool,
    last: bool,
    device: str,
    checkpointed: frozenset[int],
) -> int:
    """Saved-for-backward bytes of one micro-batch through one pipeline stage; the blocks of
    ``checkpointed`` (`checkpointed_layers`) keep their input only."""
    tokens = work.micro_batch_tokens(layout)
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    block_input = tokens * shape.dim * work.act_bytes // sp
    total = 0
    for i in layers:
        total += (
            block_input
            if i in checkpointed
            else layer_activation_bytes(shape, layout, work, tokens, device=device, layer=i)
        )
    if layout.activation_offload:
        total = 0  # saved tensors wait in host memory
    total += tokens * shape.rope_dim * 4  # RoPE cos and sin rows gathered by position ids (fp32)
    if work.document_masks and device == "cpu" and layout.cp == 1:
        total += tokens * 16  # PackedDocuments' gather and order indices (int64), shared by the layers
    if first:
        total += tokens * 8  # token ids (int64) of the embedding lookup
    if last:
        d, vocab = shape.dim, shape.vocab_size // (layout.tp if layout.loss_parallel else 1)
        total += tokens * ((2 * d + 1) * 4 // sp + d * work.act_bytes)  # final norm
        total += tokens * (4 * vocab + 8) + 8  # log-softmax output (fp32), labels, loss scalars
        total += int(tokens * adapter_bytes_per_token(shape, layout, work, None))  # an adapted head's
    return total


def inflight_microbatches(layout: Layout, pp_rank: int, num_microbatches: int) -> float:
    """Micro-batches (of this rank's whole stage set) whose activations are alive at the peak.

    GPipe runs every forward first; 1F1B keeps pp - rank; interleaved and V schedules keep their
    warm-up chunks plus one (torch's ``Interleaved1F1B`` warm-up), each chunk 1/v of the rank.
    """
    m, pp, v = num_microbatches, layout.pp, layout.stages_per_rank
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "GPipe":
        return float(m)
    if v == 1:
        return float(min(m, pp - pp_rank))
    warmup = min(m * v, (pp - pp_rank - 1) * 2 + (v - 1) * pp)
    return (warmup + 1) / v


def predict_rank(
    shape: ModelShape,
    layout: Layout,
    work: Workload,
    rank: int,
    *,
    device: str = "cuda",
    checkpointed: frozenset[int] | None = None,
) -> MemoryBreakdown:
    """Predicted memory of one global rank (``checkpointed``: `checkpointed_layers`, when known)."""
    params, grads, optim = state_bytes(shape, layout, work, rank)
    c = rank_coords(layout, rank)
    stages, layers, num_stages = stage_plan(shape, layout, c["pp"])
    checkpointed = checkpointed_layers(shape, layout) if checkpointed is None else checkpointed
    per_mb = sum(
        stage_activation_bytes(
            shape,
            layout,
            work,
            layers=layers[s],
            first=s == 0,
            last=s == num_stages - 1,
            device=device,
            checkpointed=checkpointed,
        )
        for s in stages
    )
    inflight = inflight_microbatches(layout, c["pp"], work.microbatches(layout))
    transient = _transient(shape, layout, work, stages, layers, num_stages, device)
    if layout.ist_islands > 1:  # a reassembly frees the gradients and activations, then gathers the MLPs
        reassembly = ist_reassembly_extra(shape, layout, work) - grads - int(per_mb * inflight)
        transient = max(transient, reassembly)
    return MemoryBreakdown(params, grads, optim, per_mb, inflight, transient)


def _transient(
    shape: ModelShape,
    layout: Layout,
    work: Workload,
    stages: list[int],
    layers: list[range],
    num_stages: int,
    device: str,
) -> int:
    tokens = work.micro_batch_tokens(layout)
    blocks = [i for s in stages for i in layers[s]]
    units = _unit_bytes(shape, layout, work, blocks)
    out = gathered_bytes(shape, layout, work, blocks, units)
    if out:  # and one block of unsharded gradients (the largest: an MoE one, if any)
        out += max((units[1][i] for i in blocks), default=0)
    if num_stages - 1 in stages:
        vocab = shape.vocab_size // (layout.tp if layout.loss_parallel else 1)
        out += 2 * tokens * vocab * 4  # logits (fp32) and their gradient next to the log-softmax output
    if layout.ac != "none" or layout.activation_offload:
        last = shape.n_layers - 1  # one block recomputed / reloaded (MoE if any is)
        out += layer_activation_bytes(shape, layout, work, tokens, device=device, layer=last)
    return out


def gathered_bytes(
    shape: ModelShape,
    layout: Layout,
    work: Workload,
    blocks: list[int],
    units: tuple[Counter[int | None], Counter[int | None]] | None = None,
) -> int:
    """Bytes of the parameters FSDP2 holds gathered at their peak on a rank whose blocks are
    ``blocks``: the root's (embedding, head: gathered for the whole step) and two blocks (the
    current and the prefetched one; the largest, an MoE one if any), or every block when none is
    resharded after its forward (``Layout.reshard_after_forward`` False: all of them gathered when
    the backward starts). 0 where FSDP gathers nothing (one shard and no cast). ``units``: the
    rank's `_unit_bytes`, when already computed."""
    if not (layout.uses_fsdp and (layout.fsdp_shards > 1 or work.compute_dtype != work.param_dtype)):
        return 0
    gathered, _ = units if units is not None else _unit_bytes(shape, layout, work, blocks)
    sizes = [gathered[i] for i in blocks]
    held = 2 * max(sizes, default=0)
    if not layout.reshard_after_forward:
        held = max(held, sum(sizes))
    return held + gathered[None]


def _unit_bytes(
    shape: ModelShape, layout: Layout, work: Workload, blocks: list[int]
) -> tuple[Counter[int | None], Counter[int | None]]:
    """Per FSDP unit on a rank (a block's index; None: the root), the bytes it gathers (its tp
    shard, 1/ep of the experts, in the compute dtype; QLoRA's codes as they are stored) and the
    bytes of its unsharded gradients (of its trained parameters: under LoRA the adapters only)."""
    gathered: Counter[int | None] = Counter()
    grads: Counter[int | None] = Counter()
    if work.lora is None:  # alike blocks (`ModelShape.block_kinds`) are counted once
        kind_of, kinds = shape.block_kinds
        per_kind = [_gathered_numel(kind, layout) for kind in kinds]
        for i in blocks:
            gathered[i], grads[i] = per_kind[kind_of[i]] * work.act_bytes, per_kind[kind_of[i]] * work.param_bytes
        root = _gathered_numel(shape.params_of_layer.get(None, ()), layout)
        gathered[None], grads[None] = root * work.act_bytes, root * work.param_bytes
        return gathered, grads
    for k in kept_tensors(shape, layout, work, 0):  # LoRA runs without pipeline parallelism
        n = math.prod(k.spec.shape) // (layout.tp if k.spec.tp_dim is not None else 1)
        n //= layout.ep if ".experts." in k.spec.name else 1
        gathered[k.spec.layer] += n * (work.act_bytes if k.cast else k.itemsize)
        grads[k.spec.layer] += n * work.param_bytes if k.trained else 0
    return gathered, grads


def _gathered_numel(params: Any, layout: Layout) -> int:
    """Elements of ``params`` (one block's, or the root's) that FSDP gathers on a rank: its tp shard,
    1/ep of the experts."""
    return sum(math.prod(p.shape) // (layout.ep if ".experts." in p.name else 1) for p in params) // layout.tp


def predict_memory(shape: ModelShape, layout: Layout, work: Workload, *, device: str = "cuda") -> MemoryBreakdown:
    """The rank with the largest predicted total (pipeline ranks differ; the others are alike)."""
    ranks = [rank_of(layout, pp=p) for p in range(layout.pp)]
    checkpointed = checkpointed_layers(shape, layout)  # every pp rank's blocks: computed once
    return max(
        (predict_rank(shape, layout, work, r, device=device, checkpointed=checkpointed) for r in ranks),
        key=lambda m: m.total,
    )
