"""Enumerate layouts, predict each, drop those over the memory cap, rank the rest by step time.

The space (Mist, Zhu et al. 2025; Merak, Lai et al. 2023): every factorisation of the world size
into dp_replicate x dp_shard x cp x tp x pp that the model and batch allow (tp inside a node and
dividing the heads, vocabulary and ffn width; pp at most the layers; seq_len divisible by 2 cp;
dp dividing the global batch; under LoRA no pp, and no tp with QLoRA or adapter dropout), each
pipeline schedule with its virtual stages, each context-parallel mode the heads allow, every
micro-batch size the batch divides (up to ``max_micro_batch``), and
activation checkpointing none / every other block / full, with and without activation offload.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product

from strategies.context.plugin import context_parallel_problems
from strategies.core.parallel_dims import divisors
from strategies.core.shape import ModelShape
from strategies.pipeline.layout import SCHEDULES, SPLIT_BACKWARD_SCHEDULES, check_pipeline, stages_per_rank_of
from strategies.planner.layout import KEPT, Layout, Workload
from strategies.planner.memory import MemoryBreakdown, predict_memory
from strategies.planner.time import Cluster, StepTime, predict_time, tokens_per_second_per_device
from strategies.tensor import tp_divisibility_problems


@dataclass
class Plan:
    """One layout with its predictions."""

    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    tokens_per_s: float
    fits: bool


@dataclass(frozen=True)
class SearchSpace:
    """Which knobs the search varies (the degrees are always enumerated).

    Args:
        schedules: pipeline schedules tried when pp > 1.
        cp_modes: context-parallel modes tried when cp > 1.
        ac_modes: activation checkpointing: "none", "every_2" (every other block), "full".
        offload: also try activation offload.
        max_micro_batch: largest micro-batch size tried.
        hsdp: also try dp_replicate > 1 (DDP / HSDP replicas).
    """

    schedules: Sequence[str] = ("1F1B", "Interleaved1F1B", "ZBV")
    cp_modes: Sequence[str] = ("ring", "ulysses")
    ac_modes: Sequence[str] = ("none", "every_2", "full")
    offload: bool = False
    max_micro_batch: int = 8
    hsdp: bool = True


def _degrees(
    world: int, shape: ModelShape, work: Workload, devices_per_node: int, hsdp: bool
) -> Iterator[tuple[int, ...]]:
    lora = work.lora
    for tp in divisors(world):
        if tp > devices_per_node or tp_divisibility_problems(
            tp, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab_size, ffn_dim=shape.ffn_dim
        ):
            continue
        for pp in divisors(world // tp):
            if pp > shape.n_layers or lora is not None and lora.degree_problems(pp=pp, tp=tp):
                continue
            for cp in divisors(world // (tp * pp)):
                if cp > 1 and (work.seq_len % (2 * cp) or not cp_applies(shape, work)):
                    continue
                dp = world // (tp * pp * cp)
                if work.global_batch_size % dp:
                    continue
                for dp_replicate in divisors(dp) if hsdp else [1]:
                    yield dp_replicate, dp // dp_replicate, cp, tp, pp


def cp_applies(shape: ModelShape, work: Workload) -> bool:
    """Whether context parallelism computes this model's attention: not with attention sinks, nor
    with sliding windows shorter than the rows (its cores have neither; validate refuses both,
    `trainer.capabilities.window_problems`), nor latent attention (values narrower than keys:
    `trainer.capabilities.latent_attention_problems`)."""
    short_window = shape.window_layers and shape.sliding_window is not None and work.seq_len > shape.sliding_window
    return not (shape.attention_sinks or short_window or shape.latent_attention)


def candidate_layouts(
    shape: ModelShape, work: Workload, cluster: Cluster, space: SearchSpace, kept: Layout = Layout()
) -> Iterator[Layout]:
    """Every valid layout of ``space`` on ``cluster.world_size`` ranks (with every valid ep for an
    MoE model), each with ``kept``'s settings that the search does not vary (`KEPT`: the command line's)."""
    keep = {name: getattr(kept, name) for name in KEPT}
    for dp_replicate, dp_shard, cp, tp, pp in _degrees(
        cluster.world_size, shape, work, cluster.devices_per_node, space.hsdp
    ):
        per_rank = work.global_batch_size // (dp_replicate * dp_shard)
        base = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, **keep)
        base = base if base.uses_fsdp else base.with_(fsdp_cpu_offload=False)  # nothing to offload
        eps = [d for d in divisors(dp_shard * cp) if shape.num_experts % d == 0] if shape.num_experts else [1]
        for micro in [b for b in divisors(per_rank) if b <= space.max_micro_batch]:
            for sched in space.schedules if pp > 1 else ["1F1B"]:
                if shape.num_experts and sched in SPLIT_BACKWARD_SCHEDULES:
                    continue  # refused for mixtures of experts (`strategies.expert.plugin.ExpertParallel.problems`)
                v = stages_per_rank_of(sched, None)
                if pp > 1 and check_pipeline(
                    pp=pp,
                    schedule=sched,
                    stages_per_rank=None,
                    split_points=None,
                    num_microbatches=None,
                    microbatches_per_step=per_rank // micro,
                    n_layers=shape.n_layers,
                    tie_embeddings=shape.tie_embeddings,
                ):
                    continue
                for mode in space.cp_modes if cp > 1 else ["ring"]:
                    if context_parallel_problems(
                        mode=mode, cp=cp, tp=tp, ulysses_degree=2, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads
                    ):
                        continue
                    for ac in space.ac_modes:
                        for offload, ep in product((False, True) if space.offload else (False,), eps):
                            yield base.with_(
                                pp_schedule=sched,
                                stages_per_rank=v if pp > 1 else 1,
                                cp_mode=mode,
                                micro_batch_size=micro,
                                ac="every_k" if ac.startswith("every_") else ac,
                                ac_every_k=int(ac.split("_")[1]) if ac.startswith("every_") else 1,
                                activation_offload=offload,
                                ep=ep,
                            )


def evaluate(shape: ModelShape, layout: Layout, work: Workload, cluster: Cluster) -> Plan:
    """Predictions of one layout."""
    memory = predict_memory(shape, layout, work, device=cluster.device)
    step = predict_time(shape, layout, work, cluster)
    return Plan(
        layout, memory, step, tokens_per_second_per_device(layout, work, step), memory.total <= cluster.memory_cap
    )


def search(
    shape: ModelShape, work: Workload, cluster: Cluster, space: SearchSpace = SearchSpace(), kept: Layout = Layout()
) -> list[Plan]:
    """Every candidate layout (with ``kept``'s unsearched settings), fitting ones first, each group by
    predicted step time (fastest first)."""
    plans = [evaluate(shape, layout, work, cluster) for layout in candidate_layouts(shape, work, cluster, space, kept)]
    return sorted(plans, key=lambda p: (not p.fits, p.time.total))


__all__ = ["Plan", "SearchSpace", "candidate_layouts", "evaluate", "search", "SCHEDULES"]
