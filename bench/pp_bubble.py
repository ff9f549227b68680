"""Pipeline bubble: measured idle fraction of each schedule against the theory (p-1)/(m+p-1).

For p pipeline ranks (forked gloo processes) and m micro-batches per schedule step, each schedule
runs a toy model whose stage work is a fixed sleep, so the figure measures the schedule and its
communication, not a CPU that other processes share. Per rank and micro-batch the work is F = B =
W = one unit (forward, input gradient, weight gradient; Qi et al. 2024's cost model), split evenly
over the rank's stages (2 per rank for the interleaved and V schedules). The stages are placed,
split and scheduled by plait's own `strategies.pipeline.plugin` functions (`local_stages`,
`build_schedule`), with torch's schedules underneath.

Idle fraction of a rank = 1 - (time inside its stage computations) / (wall time of the step,
from a barrier before it to a barrier after it: until the last rank is done), averaged over the
ranks (median over the timed steps of each rank). GPipe and 1F1B should match the theory,
(p-1)/(m+p-1), the bubble of one stage per rank; interleaved, zero-bubble and DualPipeV should be
below it (ratio < 1). The ratio above 1 is the price of communication and Python per action.

Invocations::

    OMP_NUM_THREADS=1 python bench/pp_bubble.py                 # p=2 and 4, m=4 and 8; about 6 minutes
    python bench/pp_bubble.py --pp 2 --unit-ms 30 --steps 1     # about 40 s, noisier

The last line is ``RESULT bubble_ratio_max=<worst measured/theory over schedules, p and m>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from strategies.pipeline.layout import SCHEDULES, local_stages, microbatch_problems, stages_per_rank_of
from strategies.pipeline.stages import build_schedule
from strategies.runtime.gloo import run_gloo_ranks


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    """One stage: ``y = sleep_B(x) * sleep_W(w)``; forward F, input gradient B, weight gradient W.

    The B sleep is on the input path and the W sleep on the parameter path, so the zero-bubble
    schedules' split backward (input gradients first, weight gradients later) splits the time too.
    """

    def __init__(self, dim: int, unit_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.unit_s = unit_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # the first stage: its input needs no gradient, its B must still run
            x = x.detach().requires_grad_()
        h = _Sleep.apply(x, self.unit_s, self.unit_s)
        return h * _Sleep.apply(self.w, 0.0, self.unit_s)


def measure(rank: int, *, pp: int, schedule: str, m: int, unit_s: float, steps: int) -> float:
    """Median idle fraction of this rank over ``steps`` timed schedule steps (after one warm-up)."""
    import torch.distributed as dist

    v = stages_per_rank_of(schedule, None)
    stages = local_stages(rank, pp=pp, stages_per_rank=v, schedule=schedule)
    modules = [SleepStage(16, unit_s / v) for _ in stages]
    sched = build_schedule(
        modules,
        stages=stages,
        num_stages=pp * v,
        schedule=schedule,
        num_microbatches=m,
        loss_fn=lambda out, target: (out * target).sum(),
        group=dist.group.WORLD,
        device=torch.device("cpu"),
    )
    busy = [0.0]
    torch_stages = sched._stages if hasattr(sched, "_stages") else [sched._stage]
    for stage in torch_stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, _timed(getattr(stage, name), busy))
    x, target = torch.ones(2 * m, 16), torch.ones(2 * m, 16)
    first, last = 0 in stages, pp * v - 1 in stages
    fractions = []
    for step in range(steps + 1):
        dist.barrier()
        busy[0], start = 0.0, time.perf_counter()
        sched.step(*((x,) if first else ()), target=target if last else None, return_outputs=False)
        dist.barrier()  # the step lasts until its last rank is done: idle includes waiting for it
        wall = time.perf_counter() - start
        if step:  # the first step also infers shapes
            fractions.append(1.0 - busy[0] / wall)
    return statistics.median(fractions)  # a load spike on the shared machine hits one step, not all


def _timed(fn: Any, busy: list[float]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--unit-ms", type=float, default=100.0, help="F = B = W per rank and micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed schedule steps per case")
    args = parser.parse_args()
    print(f"{'schedule':<22} {'p':>2} {'m':>2} {'theory':>7} {'measured':>8} {'ratio':>6}")
    ratios = []
    for pp in args.pp:
        for m in args.microbatches:
            theory = (pp - 1) / (m + pp - 1)
            for schedule in SCHEDULES:
                if microbatch_problems(
                    schedule, pp=pp, stages_per_rank=stages_per_rank_of(schedule, None), num_microbatches=m
                ):
                    print(f"{schedule:<22} {pp:>2} {m:>2} {theory:>7.3f}      n/a (too few micro-batches)")
                    continue

                def run(rank: int, pp=pp, schedule=schedule, m=m) -> float:
                    return measure(rank, pp=pp, schedule=schedule, m=m, unit_s=args.unit_ms / 1e3, steps=args.steps)

                idle = sum(run_gloo_ranks(pp, run, timeout_s=300)) / pp
                ratios.append(idle / theory)
                print(f"{schedule:<22} {pp:>2} {m:>2} {theory:>7.3f} {idle:>8.3f} {idle / theory:>6.2f}", flush=True)
    print(f"RESULT bubble_ratio_max={max(ratios):.3f}")


if __name__ == "__main__":
    main()
