"""Predicted step time of one layout: FLOPs over achievable rates, bytes over links, with overlap.

Sources: Narayanan et al. 2021 (Megatron-LM: tensor-parallel all-gather/reduce-scatter volumes,
pipeline bubble (pp - 1) / (m v) of interleaved 1F1B); Qi et al. 2024 (zero-bubble schedules);
Zhao et al. 2023 (FSDP: all-gather in forward and backward, reduce-scatter of gradients, both
prefetched under compute); Liu et al. 2023 (ring attention: k/v blocks passed under the block
computation); Pipette (Yim et al. 2024, DATE) and Mist (Zhu et al. 2025) for a critical-path model
with overlap checked against real runs.

Per micro-batch and layer: matmul FLOPs (6 x weights x tokens, + 2 x for recomputation under
checkpointing) at ``peak x matmul_efficiency``, causal attention FLOPs at ``peak x
attention_efficiency``, elementwise traffic (the saved activations, read and written a few times)
at HBM bandwidth, and a per-layer dispatch overhead (CPU eager; DTensor layouts pay more). Tensor-
and Ulysses-parallel collectives are exposed (async TP hides a fraction); ring attention's k/v passes hide
under the attention; FSDP's gathers and reduce-scatters hide under the compute except one layer's
worth (on CPU ranks nothing hides: gloo runs on the cores that compute). The pipeline adds its
bubble and stage-to-stage sends; the optimizer streams its state. A local-SGD layout's islands
(``Layout.local_sgd``) skip the per-step all-reduce across dp_replicate: their exchanges (DiLoCo's
pseudo-gradient every H steps, DES-LOC's parameters and moments, ...) run after a step, blocking,
and count at their average per step (``Layout.replica_exchange``; Douillard et al. 2023).

LoRA (``Workload.lora``): the frozen base computes no weight gradients, so its matmuls (blocks and
head) run one forward's worth less in the backward, and its embedding writes no dense gradient;
the adapters' matmuls (`adapter_params`) run in full. FSDP gathers every parameter (QLoRA's codes
as stored, 4 bits a weight) but reduce-scatters, and HSDP/DDP all-reduce, the adapters' gradients
only; the optimizer streams and Muon orthogonalises the adapters only. Not modelled: the first
block's input needs no gradient (its projections' input gradients are skipped too), and QLoRA's
dequantisation of each 4-bit weight before its matmuls (forward and backward).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from strategies.core.shape import ModelShape
from strategies.muon import newton_schulz_flops, takes_muon
from strategies.pipeline.layout import balanced_split_points
from strategies.planner.activations import layer_activation_bytes
from strategies.planner.kept import adapter_specs, kept_tensors
from strategies.planner.layout import Layout, Workload
from strategies.planner.memory import local_sgd_bytes, state_bytes
from strategies.planner.ranks import checkpointed_layers, rank_of, stage_plan

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Cluster:
    """A machine type and its links (conf/cluster/*.yaml; measured by `calibrate`).

    Args:
        name: preset name.
        device: "cuda" or "cpu".
        devices_per_node, num_nodes: ranks per node and nodes.
        memory_gib: memory per device; ``reserved_gib`` of it is not for tensors (context,
            communication buffers, allocator slack).
        peak_flops: dense matmul peak per device in the compute dtype (FLOP/s); ``peak_flops_fp8``
            for float8 matmuls.
        matmul_efficiency, attention_efficiency: achievable fractions of the peak.
        hbm_bandwidth: device memory bandwidth (bytes/s).
        intra_node_bandwidth, inter_node_bandwidth: achievable collective bus bandwidth per device
            (bytes/s) inside a node and across nodes.
        latency_s: per-collective latency.
        layer_overhead_s: host dispatch time per layer, micro-batch and pass (eager CPU); DTensor
            layouts (tp > 1) pay ``dtensor_overhead`` times it.
        step_overhead_s: fixed time per optimizer step (loop, logging).
        cores: CPU cores shared by the ranks of a node (None on accelerators): more ranks than
            cores share them.
        elementwise_passes: reads+writes of each saved activation byte per pass (halved by compile).
        async_tp_overlap: fraction of the tensor-parallel collectives async TP hides (torchtitan
            reports 1.04-1.16x from async TP, so a fraction, not all, of them).
    """

    name: str = "cluster"
    device: str = "cuda"
    devices_per_node: int = 8
    num_nodes: int = 1
    memory_gib: float = 80.0
    reserved_gib: float = 2.0
    peak_flops: float = 989e12
    peak_flops_fp8: float = 1979e12
    matmul_efficiency: float = 0.6
    attention_efficiency: float = 0.4
    hbm_bandwidth: float = 3.35e12
    intra_node_bandwidth: float = 360e9
    inter_node_bandwidth: float = 45e9
    latency_s: float = 20e-6
    layer_overhead_s: float = 0.0
    dtensor_overhead: float = 1.0
    step_overhead_s: float = 0.0
    cores: int | None = None
    elementwise_passes: float = 4.0
    async_tp_overlap: float = 0.2

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def memory_cap(self) -> float:
        return (self.memory_gib - self.reserved_gib) * 1024**3


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step on the slowest rank, by part."""

    compute: float
    tp_comm: float
    cp_comm: float
    fsdp_comm: float
    pp_bubble: float
    pp_comm: float
    optimizer: float
    overhead: float
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (mixtures of experts)

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def axis_bandwidth(layout: Layout, cluster: Cluster, axes: tuple[str, ...]) -> float:
    """Bus bandwidth of a collective over ``axes``: intra-node when the group's ranks (with the mesh's
    inner axes between them) fit in one node, else the inter-node link."""
    inner = 1
    for axis in reversed(MESH_AXES):
        inner *= getattr(layout, axis)
        if axis == min(axes, key=MESH_AXES.index):
            break
    return cluster.intra_node_bandwidth if inner <= cluster.devices_per_node else cluster.inter_node_bandwidth


def _rate_share(layout: Layout, cluster: Cluster) -> float:
    """Fraction of one device's peak a rank gets (CPU ranks beyond the cores share them)."""
    if cluster.cores is None:
        return 1.0
    ranks_per_node = min(layout.world_size, cluster.devices_per_node)
    return min(1.0, cluster.cores / ranks_per_node)


def layer_costs(
    shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster
) -> tuple[float, list[float], float]:
    """Seconds of forward + backward (+ recomputation) of one micro-batch, per part of the model:
    ``(embedding, [each block], final norm + output head + loss)``. The parts a pipeline stage
    holds add up to its time (`stage_compute`), so they also choose cost-balanced stages
    (`strategies.pipeline.layout.balanced_split_points`). The blocks recomputed are
    `checkpointed_layers` of ``layout``'s own split (what a rank's every_k picks depends on it)."""
    tokens = work.micro_batch_tokens(layout)
    share = _rate_share(layout, cluster)
    mm_peak = (cluster.peak_flops_fp8 if work.float8 else cluster.peak_flops) * cluster.matmul_efficiency * share
    attn_peak = cluster.peak_flops * cluster.attention_efficiency * share
    layer_attn = 2 * tokens * work.seq_len * shape.attention_width / layout.tp  # causal: half of QK^T and AV
    passes = cluster.elementwise_passes * (0.5 if work.compile else 1.0)
    dispatch = cluster.layer_overhead_s * (cluster.dtensor_overhead if layout.tp > 1 else 1.0)
    checkpointed = checkpointed_layers(shape, layout)
    blocks = []
    for i in range(shape.n_layers):
        # An MoE block's active weights (MoE blocks are replicated over tp: a simplification here).
        layer_mm = 2 * tokens * shape.matmul_params_per_layer(i) / layout.tp
        layer_bytes = layer_activation_bytes(shape, layout, work, tokens, device=cluster.device, layer=i)
        fwd_passes = 4 if i in checkpointed else 3  # forward, backward = 2 forwards, recomputed forward
        cost = fwd_passes * (layer_mm / mm_peak + layer_attn / attn_peak)
        if work.lora is not None:  # a frozen base: no weight gradients; the adapters' matmuls in full
            cost += (fwd_passes * 2 * tokens * adapter_params(shape, layout, work, i) - layer_mm) / mm_peak
        blocks.append(cost + fwd_passes * (passes * layer_bytes / cluster.hbm_bandwidth + dispatch) / share)
    # The lookup writes the hidden states; its backward adds them into a dense [V/tp, D] gradient
    # (none for LoRA's frozen embedding).
    vocab = shape.vocab_size / layout.tp
    gradient = 2 * vocab * shape.dim * work.param_bytes if work.lora is None else 0
    embedding = (3 * tokens * shape.dim * work.act_bytes + gradient) / cluster.hbm_bandwidth / share
    head_mm = 2 * tokens * shape.dim * vocab
    head = 3 * head_mm / mm_peak + 3 * tokens * 4 * vocab * 2 / cluster.hbm_bandwidth / share
    if work.lora is not None:  # the frozen head's weight gradient skipped, an adapted head's adapters added
        head += (3 * 2 * tokens * adapter_params(shape, layout, work, None) - head_mm) / mm_peak
    return embedding, blocks, head


def adapter_params(shape: ModelShape, layout: Layout, work: Workload, layer: int | None) -> int:
    """Elements of LoRA's adapters (`strategies.planner.kept.adapter_specs`, this rank's tp
    shards) on the adapted layers of block ``layer`` (None: the head): the weights each token meets
    in their matmuls. 0 without LoRA."""
    lora = work.lora
    if lora is None:
        return 0
    specs = [x for p in filter(lora.adapts, shape.params_of_layer.get(layer, ())) for x in adapter_specs(p, lora)]
    return sum(_numel(x, layout) for x in specs)


def stage_compute(costs: tuple[float, list[float], float], *, layers: range, first: bool, last: bool) -> float:
    """Seconds of forward + backward (+ recomputation) of one micro-batch through one stage, from
    the layout's `layer_costs` (computed once per layout, summed per stage)."""
    embedding, blocks, head = costs
    return embedding * first + sum(blocks[i] for i in layers) + head * last


def stage_costs(shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster) -> list[float]:
    """Predicted seconds of one micro-batch through each pipeline stage (the layout's split)."""
    _, layers, num_stages = stage_plan(shape, layout, 0)
    costs = layer_costs(shape, layout, work, cluster)
    return [stage_compute(costs, layers=layers[s], first=s == 0, last=s == num_stages - 1) for s in range(num_stages)]


def auto_split_points(shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster) -> list[int]:
    """Split points (first layer of every stage but the first) that minimise the slowest stage
    under this time model: ``strategy.pipeline.split=auto`` (Merak, Lai et al. 2023, partitions
    stages by balanced cost in the same spirit)."""
    embedding, blocks, head = layer_costs(shape, layout, work, cluster)
    return balanced_split_points(blocks, layout.pp * layout.stages_per_rank, first=embedding, last=head)


def _collective(volume: float, count: int, bandwidth: float, cluster: Cluster) -> float:
    return volume / bandwidth + count * cluster.latency_s


def muon_time(shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster, pp_rank: int) -> float:
    """Seconds of Muon's orthogonalisation on a rank of ``pp_rank`` (`strategies.muon.orthogonalize`).

    Each trained hidden matrix (`takes_muon` with the run's ``Workload.adamw_params``; under LoRA
    the adapters) is orthogonalised once among the ranks that shard it (dp_shard x cp, x tp when
    tp splits it; every DDP replica does all of its own): `newton_schulz_flops` / those ranks at
    the matmul rate, plus two all_to_all per batch of that many matrices, each rank sending its
    shard of the others' matrices ((n - 1) / n of its shard, in the parameters' dtype).
    """
    rate = cluster.peak_flops * cluster.matmul_efficiency * _rate_share(layout, cluster)
    flops = volume = batches = 0.0
    for p, count, trained, *_ in kept_tensors(shape, layout, work, pp_rank):
        if trained and takes_muon(p.name, len(p.shape), work.adamw_params):
            owners = layout.dp_shard * layout.cp * (layout.tp if p.tp_dim is not None else 1)
            flops += count * newton_schulz_flops(p.shape) / owners
            volume += count * 2 * math.prod(p.shape) / owners * (owners - 1) / owners * work.param_bytes
            batches += count / owners if owners > 1 else 0
    bw = axis_bandwidth(layout, cluster, ("dp_shard", "cp", "tp"))
    return flops / rate + _collective(volume, 2 * math.ceil(batches), bw, cluster)


def predict_time(shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster) -> StepTime:
    """Predicted time of one optimizer step (seconds), on the slowest pipeline rank."""
    m = work.microbatches(layout)
    tokens = work.micro_batch_tokens(layout)
    a = work.act_bytes
    stage_times, rank_layers = [], []
    costs = layer_costs(shape, layout, work, cluster)
    for pp_rank in range(layout.pp):
        stages, layers, num_stages = stage_plan(shape, layout, pp_rank)
        stage_times.append(
            sum(stage_compute(costs, layers=layers[s], first=s == 0, last=s == num_stages - 1) for s in stages)
        )
        rank_layers.append(sum(len(layers[s]) for s in stages))
    slowest = max(range(layout.pp), key=lambda r: stage_times[r])
    t_mb, n_layers = stage_times[slowest], rank_layers[slowest]
    compute = m * t_mb
    passes = 3 if layout.ac != "full" else 4  # forward-like passes that run the layer's collectives

    tp_comm = 0.0
    if layout.tp > 1:  # all-gather + reduce-scatter around attention and MLP, per pass
        per = tokens * shape.dim * a * (layout.tp - 1) / layout.tp
        bw = axis_bandwidth(layout, cluster, ("tp",))
        tp_comm = (
            m
            * n_layers
            * passes
            * _collective(4 * per, 4, bw, cluster)
            * (1.0 - cluster.async_tp_overlap if work.async_tp else 1.0)
        )

    cp_comm = 0.0
    if layout.cp > 1:
        e, kv, heads = shape.head_dim, shape.n_kv_heads // layout.tp, shape.n_heads // layout.tp
        bw = axis_bandwidth(layout, cluster, ("cp",))
        if layout.cp_mode == "ulysses":
            per = tokens * (2 * heads + 2 * kv) * e * a * (layout.cp - 1) / layout.cp
            cp_comm = m * n_layers * passes * _collective(per, 4, bw, cluster)
        else:  # ring: k and v blocks (and their gradients in backward) pass cp - 1 times, under the attention
            kv_bytes = tokens * 2 * kv * e * a * (layout.cp - 1)
            ring = _collective(kv_bytes * passes, 2 * passes * (layout.cp - 1), bw, cluster)
            attn = (
                passes
                * 2
                * tokens
                * work.seq_len
                * shape.dim
                / layout.tp
                / (cluster.peak_flops * cluster.attention_efficiency * _rate_share(layout, cluster))
            )
            hidden = 0.0 if cluster.cores is not None else attn  # CPU: the cores that compute also send
            cp_comm = (
                m * n_layers * max(0.0, ring - hidden) + m * n_layers * 2 * passes * (layout.cp - 1) * cluster.latency_s
            )

    ep_comm = 0.0
    stages, layers, _ = stage_plan(shape, layout, slowest)
    moe_layers = sum(shape.is_moe(i) for s in stages for i in layers[s])
    if layout.ep > 1 and moe_layers:
        # Per MoE block and pass: rows out to their experts' ranks and back (balanced routing: a
        # rank keeps 1/ep of its top_k x tokens rows), plus the counts exchange.
        per = tokens * shape.top_k * shape.dim * a * (layout.ep - 1) / layout.ep
        intra = layout.tp * layout.ep <= cluster.devices_per_node  # ep ranks are tp apart
        bw = cluster.intra_node_bandwidth if intra else cluster.inter_node_bandwidth
        ep_comm = m * moe_layers * passes * _collective(2 * per, 3, bw, cluster)

    fsdp_comm = 0.0
    rank = rank_of(layout, pp=slowest)
    held = kept_tensors(shape, layout, work, slowest)
    trained = [k for k in held if k.trained]  # what gradients are reduced for: under LoRA the adapters
    params_rank = sum(k.count * _numel(k.spec, layout) for k in trained)
    # What FSDP gathers (bytes: in its gather dtype, QLoRA's codes as stored) and reduce-scatters
    # (elements): a rank's experts are 1/ep of a block's (its shard is not).
    gathered = reduced = 0
    for k in held:
        n = k.count * (_numel(k.spec, layout) // (layout.ep if ".experts." in k.spec.name else 1))
        gathered += n * (work.gather_bytes if k.cast else k.itemsize)
        reduced += n if k.trained else 0
    if layout.uses_fsdp:
        s, r = layout.fsdp_shards, layout.dp_replicate
        bw = axis_bandwidth(layout, cluster, ("dp_shard", "cp") if s > 1 else ("dp_replicate",))
        comm = 0.0
        if s > 1:
            # forward and backward of every micro-batch (forward only when blocks stay gathered for backward)
            gathers = (2 if layout.reshard_after_forward else 1) * m
            comm += _collective(gathers * gathered * (s - 1) / s, gathers * (n_layers + 1), bw, cluster)
            comm += _collective(reduced * work.param_bytes * (s - 1) / s, n_layers + 1, bw, cluster)
        replica = 0.0
        if r > 1:
            bw_r = axis_bandwidth(layout, cluster, ("dp_replicate",))
            replica = _collective(2 * params_rank / s * work.param_bytes * (r - 1) / r, n_layers + 1, bw_r, cluster)
            if not layout.local_sgd:
                comm += replica
        # Prefetched under compute; one layer's worth (the first gather, the last reduction) shows.
        # On CPU ranks (gloo) the same cores compute and communicate: nothing hides.
        fsdp_comm = comm if cluster.cores is not None else max(0.0, comm - compute) + comm / max(n_layers, 1)
        if layout.local_sgd:  # the islands' exchanges, every so many steps: amortised, blocking unless overlapped
            exchange = replica * layout.replica_exchange
            hidden = layout.replica_overlapped and cluster.cores is None
            fsdp_comm += max(0.0, exchange - compute) if hidden else exchange

    pp_bubble = pp_comm = 0.0
    if layout.pp > 1:
        v = layout.stages_per_rank
        bubble = (layout.pp - 1) / v * (t_mb / 1.0)
        if layout.pp_schedule in ("InterleavedZeroBubble", "ZBV", "DualPipeV"):
            bubble /= 3  # weight-gradient work fills most of the bubble
        pp_bubble = bubble
        hop = tokens * shape.dim * a / (layout.tp if layout.sequence_parallel else 1)
        bw = axis_bandwidth(layout, cluster, ("pp",))
        pp_comm = _collective(2 * m * v * hop, 2 * m * v, bw, cluster)

    params_b, grads_b, optim_b = state_bytes(shape, layout, work, rank)
    optim_b -= local_sgd_bytes(shape, layout, work, rank)  # touched at an exchange, not by every step
    # It reads the trained parameters, their gradients and states, and writes parameters and states:
    # under LoRA the adapters, as many bytes as their gradients.
    updated = params_b if work.lora is None else grads_b
    optimizer = (updated + grads_b + 2 * optim_b) / cluster.hbm_bandwidth / _rate_share(layout, cluster)
    optimizer += sum(k.count for k in trained) * cluster.layer_overhead_s / 4
    if work.optimizer == "muon":
        optimizer += muon_time(shape, layout, work, cluster, slowest)
    step = StepTime(
        compute, tp_comm, cp_comm, fsdp_comm, pp_bubble, pp_comm, optimizer, cluster.step_overhead_s, ep_comm
    )
    share = _rate_share(layout, cluster)
    if share < 1.0:
        # CPU ranks beyond the cores: gloo's copies and reductions and the host's dispatch and
        # loop run on the same shared cores as the compute (already scaled) and slow down alike.
        for part in ("tp_comm", "cp_comm", "fsdp_comm", "pp_comm", "overhead", "ep_comm"):
            setattr(step, part, getattr(step, part) / share)
    return step


def _numel(p, layout: Layout) -> int:
    n = math.prod(p.shape)
    return n // layout.tp if p.tp_dim is not None and layout.tp > 1 else n


def tokens_per_second_per_device(layout: Layout, work: Workload, step: StepTime) -> float:
    """Training tokens per second per device."""
    return work.global_batch_size * work.seq_len / step.total / layout.world_size
