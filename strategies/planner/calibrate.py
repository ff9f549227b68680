"""Calibration: measure this machine's achievable rates and put them into a `Cluster`.

A short profiled run (Pipette, Yim et al. 2024, measures links; Mist profiles kernels): an fp32
matmul of Llama-block shape (achieved FLOP/s), causal SDPA (its share of that), a large copy
(memory bandwidth), one small Llama block forward and backward at one token (host dispatch time
per layer), and, between two forked gloo ranks, a 4-byte and a 16 MiB all-reduce (latency and bus
bandwidth). Takes a few seconds; uses the threads torch uses in this process (set
OMP_NUM_THREADS as the ranks will).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from strategies.planner.time import Cluster


def _best(fn, repeats: int = 5, inner: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def matmul_flops(n: int = 1024, k: int = 256, m: int = 768) -> float:
    """Achieved fp32 FLOP/s of an [n, k] x [k, m] matmul."""
    a, b = torch.randn(n, k), torch.randn(k, m)
    return 2 * n * k * m / _best(lambda: a @ b)


def attention_flops(b: int = 4, h: int = 4, t: int = 256, e: int = 32) -> float:
    """Achieved FLOP/s of causal SDPA (half of QK^T and AV counted)."""
    q, k, v = (torch.randn(b, h, t, e) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return 2 * b * h * t * t * e / _best(lambda: sdpa(q, k, v, is_causal=True))


def memory_bandwidth(mib: int = 64) -> float:
    """Bytes/s of a large copy (read + write)."""
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src))


def layer_overhead(dim: int = 64) -> float:
    """Seconds of host dispatch per layer and pass: a tiny block's forward + backward at one token / 3."""
    from trainer.models.attention import rope_tables
    from trainer.models.llama import TransformerBlock

    block = TransformerBlock(dim, 4, 2, 192, 1e-5)
    cos, sin = rope_tables(dim // 4, 1, 10000.0)
    x = torch.randn(1, 1, dim, requires_grad=True)

    def step() -> None:
        block(x, cos[None, :, None, :], sin[None, :, None, :], None).sum().backward()

    return _best(step, repeats=5, inner=20) / 3


def gloo_link(world_size: int = 2) -> tuple[float, float]:
    """(latency seconds, bus bandwidth bytes/s) of gloo all-reduce between forked local ranks."""
    from strategies.gloo import run_gloo_ranks

    def probe(rank: int) -> tuple[float, float]:
        import torch.distributed as dist

        small, large = torch.zeros(1), torch.zeros(4 * 2**20)
        latency = _best(lambda: dist.all_reduce(small), repeats=5, inner=10)
        seconds = _best(lambda: dist.all_reduce(large), repeats=3, inner=2)
        return latency, 2 * (world_size - 1) / world_size * large.numel() * 4 / seconds

    results = run_gloo_ranks(world_size, probe, timeout_s=120)
    return max(r[0] for r in results), min(r[1] for r in results)


def calibrate_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` with this machine's measured rates (CPU: per rank of one thread group).

    Keeps the preset's memory, node shape and DTensor factor; matmul_efficiency becomes 1 (the peak
    is the achieved rate).
    """
    flops = matmul_flops()
    latency, bandwidth = gloo_link()
    return replace(
        cluster,
        name=f"{cluster.name} (calibrated)",
        peak_flops=flops,
        peak_flops_fp8=flops,
        matmul_efficiency=1.0,
        attention_efficiency=min(1.0, attention_flops() / flops),
        hbm_bandwidth=memory_bandwidth(),
        intra_node_bandwidth=bandwidth,
        latency_s=latency,
        layer_overhead_s=layer_overhead(),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    )
