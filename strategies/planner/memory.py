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

Activations per block are `strategies.planner.activations`'; here a stage's and a step's.

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
from dataclasses import asdict, dataclass
from typing import Any

from strategies.core.shape import ModelShape, ParamSpec
from strategies.muon import takes_muon
from strategies.planner.activations import adapter_bytes_per_token, layer_activation_bytes
from strategies.planner.kept import kept_tensors
from strategies.planner.layout import MUON_MATRIX_STATES, OPTIMIZER_STATES, Layout, Workload
from strategies.planner.ranks import (
    checkpointed_layers,
    local_numel,
    rank_coords,
    rank_of,
    rank_param_counts,
    stage_plan,
)

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
    casts = work.casts_weights(layout)
    for i in layers:
        total += (
            block_input
            if i in checkpointed
            else layer_activation_bytes(shape, layout, work, tokens, device=device, layer=i)
            + (cast_weight_bytes(shape.params_of_layer.get(i, ()), layout, work) if casts else 0)
        )
    if last and casts:  # the output head's copy (a tied head's weight is the embedding's)
        root = shape.params_of_layer.get(None, ())
        head = [p for p in root if "embed" not in p.name and len(p.shape) == 2] or [
            p for p in root if "embed" in p.name
        ]
        total += cast_weight_bytes(head, layout, work)
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
    """Predicted memory of one global rank (``checkpointed``: `checkpointed_layers`, when known).
    Under FSDP's CPU offload (``Layout.fsdp_cpu_offload``) the sharded parameters, gradients and
    optimizer state are in host memory: 0 on the device (its gathered blocks stay, `_transient`)."""
    params, grads, optim = state_bytes(shape, layout, work, rank)
    if layout.fsdp_cpu_offload and layout.uses_fsdp:
        params = grads = optim = 0
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
    if not (layout.fsdp_wraps and (layout.fsdp_shards > 1 or work.gather_bytes != work.param_bytes)):
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
            gathered[i], grads[i] = per_kind[kind_of[i]] * work.gather_bytes, per_kind[kind_of[i]] * work.param_bytes
        root = _gathered_numel(shape.params_of_layer.get(None, ()), layout)
        gathered[None], grads[None] = root * work.gather_bytes, root * work.param_bytes
        return gathered, grads
    for k in kept_tensors(shape, layout, work, 0):  # LoRA runs without pipeline parallelism
        n = math.prod(k.spec.shape) // (layout.tp if k.spec.tp_dim is not None else 1)
        n //= layout.ep if ".experts." in k.spec.name else 1
        gathered[k.spec.layer] += n * (work.gather_bytes if k.cast else k.itemsize)
        grads[k.spec.layer] += n * work.param_bytes if k.trained else 0
    return gathered, grads


def cast_weight_bytes(params: Any, layout: Layout, work: Workload) -> int:
    """Bytes of the compute-dtype copies autocast makes of the Linear weights among ``params`` (2-D:
    not norms, not biases, not the stacked 3-D experts, whose grouped GEMM autocast does not cast) on a
    rank and saves for the backward (`Workload.casts_weights`)."""
    matmul = [p for p in params if len(p.shape) == 2]
    return sum(math.prod(p.shape) // (layout.tp if p.tp_dim is not None else 1) for p in matmul) * work.act_bytes


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
