"""Calibration: measure this machine's achievable rates and put them into a `Cluster`.

A short profiled run (Pipette, Yim et al. 2024, measures links; Mist profiles kernels): an fp32
matmul of Llama-block shape (achieved FLOP/s), causal SDPA (its share of that), a large copy
(memory bandwidth), one small block of the planned model forward and backward at one token (host
dispatch time per layer) and the same under tensor parallelism (DTensor's dispatch factor), and,
between two forked gloo ranks, a 4-byte and a 16 MiB all-reduce (latency and bus bandwidth). The
models are the caller's (`calibrate_cluster` takes them): this module knows no model family. Takes
a few seconds; uses the threads torch uses in this process (set OMP_NUM_THREADS as the ranks will).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from strategies.planner.time import Cluster
from strategies.runtime.gloo import run_gloo_ranks
from strategies.tensor import TensorParallel


def _best(fn, repeats: int = 5, inner: int = 3, *, median: bool = False) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return sorted(times)[len(times) // 2] if median else min(times)


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


def layer_overhead(block: nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    """Seconds of host dispatch per layer and pass: a tiny block's forward + backward at one token / 3.

    Args:
        block: one transformer block of the planned model family (width 64 is enough).
        inputs: its forward's arguments for one token (the first requires grad).
    """

    def step() -> None:
        block(*inputs).sum().backward()

    return _best(step, repeats=5, inner=20) / 3


def gloo_link(world_size: int = 2) -> tuple[float, float]:
    """(latency seconds, bus bandwidth bytes/s) of gloo all-reduce between forked local ranks.

    Medians, not minima: with more ranks than cores a collective waits for descheduled ranks, and
    that wait is part of what a step pays."""

    def probe(rank: int) -> tuple[float, float]:
        small, large = torch.zeros(1), torch.zeros(4 * 2**20)
        latency = _best(lambda: dist.all_reduce(small), repeats=7, inner=10, median=True)
        seconds = _best(lambda: dist.all_reduce(large), repeats=3, inner=2, median=True)
        return latency, 2 * (world_size - 1) / world_size * large.numel() * 4 / seconds

    results = run_gloo_ranks(world_size, probe, timeout_s=120)
    return max(r[0] for r in results), min(r[1] for r in results)


def dtensor_overhead_factor(model_fn: Callable[[int], nn.Module], world_size: int = 2) -> float:
    """Host time of a tensor-parallel (DTensor) layer over a plain one, at one token per pass.

    Both are a one-layer model forward + backward at 2 tokens (dispatch-bound); the TP one is
    sharded over ``world_size`` forked gloo ranks with plait's plan (sequence and loss parallel).

    Args:
        model_fn: builds the one-layer model (with a ``tp_plan``) for a vocabulary size, seeded.
    """

    def probe(rank: int) -> float:
        ids = torch.zeros(1, 2 * world_size, dtype=torch.long)
        plain, sharded = model_fn(64 * world_size), model_fn(64 * world_size)
        plugin = TensorParallel()
        plugin.apply(sharded, {"tp": init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))})

        def step(m: torch.nn.Module) -> None:
            with plugin.loss_context():
                loss = torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
                loss.backward()

        def plain_step() -> None:
            torch.nn.functional.cross_entropy(plain(ids).flatten(0, 1), ids.flatten()).backward()

        t_plain = _best(plain_step, repeats=5, inner=5, median=True)
        return _best(lambda: step(sharded), repeats=5, inner=5, median=True) / t_plain

    return max(run_gloo_ranks(world_size, probe, timeout_s=120))


def calibration_problem(cluster: Cluster) -> str | None:
    """Why ``cluster`` cannot take this machine's measured rates (None: it can).

    The probes measure the host (CPU matmuls, gloo links between forked local ranks): they are
    this machine's figures only for a CPU preset; a GPU preset keeps its hardware's figures."""
    if cluster.device != "cpu":
        return (
            f"planner.calibrate=true measures this machine (CPU matmuls, gloo links) and would replace "
            f"cluster={cluster.name}'s {cluster.device} figures with them; use planner.calibrate=false with a GPU "
            f"preset, or cluster=cpu to plan for this machine"
        )
    return None


def calibrate_cluster(
    cluster: Cluster, *, block: tuple[nn.Module, Sequence[torch.Tensor]], model_fn: Callable[[int], nn.Module]
) -> Cluster:
    """``cluster`` with this machine's measured rates (CPU: per rank of one thread group).

    The links are measured between ``cluster.devices_per_node`` local ranks (at least 2): the
    ranks of one node, as the run will have them on this machine (the measured link is the
    intra-node one; the other nodes are never forked). Keeps the preset's memory and node shape;
    matmul_efficiency becomes 1 (the peak is the achieved rate).

    Args:
        block: a tiny block of the planned model family and its one-token inputs (`layer_overhead`).
        model_fn: a one-layer model of that family for a vocabulary size (`dtensor_overhead_factor`).

    Raises:
        ValueError: a preset that is not this machine's kind (`calibration_problem`).
    """
    if (problem := calibration_problem(cluster)) is not None:
        raise ValueError(problem)
    flops = matmul_flops()
    latency, bandwidth = gloo_link(max(2, cluster.devices_per_node))
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
        layer_overhead_s=layer_overhead(*block),
        dtensor_overhead=dtensor_overhead_factor(model_fn),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    )
