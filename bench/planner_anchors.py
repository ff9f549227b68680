"""Planner tokens/s per GPU vs torchtitan's published Llama 3.1 figures (no GPU needed).

Published: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (H100 96 GB HBM2e,
500 W, 8 per node, 400 Gb/s per GPU across nodes; seq_len 8192). Each row is that table's layout,
batch, activation checkpointing and kernels (compile, float8, async TP) predicted with the
``h100x<N>`` presets, whose memory and HBM bandwidth are set to that machine's (96 GiB,
2.4 TB/s). The presets' efficiencies were set once, before these rows were compared, and are the
same for every row. torchtitan's selective (per-op) checkpointing is modelled as checkpointing
every other block; its PP runs keep FSDP parameters gathered across micro-batches, as modelled.

    python bench/planner_anchors.py

The last line is ``RESULT max_abs_err=<x> within_25pct=<k>/<n>``.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from strategies.core.shape import ModelShape
from strategies.planner.layout import Layout, Workload
from strategies.planner.memory import GiB, predict_memory
from strategies.planner.time import Cluster, predict_time, tokens_per_second_per_device
from trainer.compose import CONF_DIR, compose
from trainer.config import validate


def cluster(n: int) -> Cluster:
    fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "cluster" / f"h100x{n}.yaml"))
    return Cluster(**{**fields, "memory_gib": 96, "hbm_bandwidth": 2.4e12})


def shape(name: str) -> ModelShape:
    """The model preset's shape, as a run resolves it (built on the meta device)."""
    return validate(compose("pretrain", [f"model={name}"]), for_launch=False).shape


def work(batch: int, **kernels: bool) -> Workload:
    return Workload(8192, batch, "fp32", "bf16", document_masks=False, **kernels)


SAC = {"ac": "every_k", "ac_every_k": 2}
ROWS = [  # (table row, model, GPUs, layout, workload, published TPS/GPU, published GiB)
    ("T1 8B FSDP8", "llama3_8b", 8, Layout(dp_shard=8, micro_batch_size=2, **SAC), work(16), 5762, 82.4),
    (
        "T1 8B FSDP8 +compile",
        "llama3_8b",
        8,
        Layout(dp_shard=8, micro_batch_size=2, **SAC),
        work(16, compile=True),
        6667,
        77.0,
    ),
    (
        "T1 8B FSDP8 +compile+fp8",
        "llama3_8b",
        8,
        Layout(dp_shard=8, micro_batch_size=2, **SAC),
        work(16, compile=True, float8=True),
        8532,
        76.8,
    ),
    ("T3 8B FSDP128", "llama3_8b", 128, Layout(dp_shard=128, micro_batch_size=2, **SAC), work(256), 5605, 67.0),
    (
        "T4 70B FSDP32xTP8",
        "llama3_70b",
        256,
        Layout(dp_shard=32, tp=8, micro_batch_size=16, ac="full"),
        work(512, compile=True, float8=True),
        829,
        71.9,
    ),
    (
        "T4 70B FSDP32xTP8 +asyncTP",
        "llama3_70b",
        256,
        Layout(dp_shard=32, tp=8, micro_batch_size=16, ac="full"),
        work(512, compile=True, float8=True, async_tp=True),
        876,
        67.6,
    ),
    (
        "T5 405B FSDP8xTP8xPP8 1F1B",
        "llama3_405b",
        512,
        Layout(dp_shard=8, tp=8, pp=8, micro_batch_size=1, ac="full", reshard_after_forward=False),
        work(256, compile=True, float8=True, async_tp=True),
        100,
        82.5,
    ),
    (
        "T5 405B FSDP8xTP8xPP8 Interleaved1F1B",
        "llama3_405b",
        512,
        Layout(
            dp_shard=8,
            tp=8,
            pp=8,
            pp_schedule="Interleaved1F1B",
            stages_per_rank=2,
            micro_batch_size=1,
            ac="full",
            reshard_after_forward=False,
        ),
        work(256, compile=True, float8=True, async_tp=True),
        128,
        72.7,
    ),
]


def main() -> None:
    print(
        "| Published configuration | GPUs | published TPS/GPU | predicted TPS/GPU | error | published GiB | predicted GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    errors = []
    for name, model, gpus, layout, wl, published, gib in ROWS:
        s, c = shape(model), cluster(gpus)
        tps = tokens_per_second_per_device(layout, wl, predict_time(s, layout, wl, c))
        mem = predict_memory(s, layout, wl)
        errors.append(tps / published - 1)
        print(f"| {name} | {gpus} | {published:,} | {tps:,.0f} | {errors[-1]:+.0%} | {gib} | {mem.total / GiB:.1f} |")
    within = sum(abs(e) <= 0.25 for e in errors)
    print(f"RESULT max_abs_err={max(abs(e) for e in errors):.3f} within_25pct={within}/{len(errors)}")


if __name__ == "__main__":
    main()
