"""Pipeline layout: which layers each stage holds, which rank runs each stage, and the checks of
a layout against the model and the step's micro-batches (before any process group exists).

Pure functions, used by the `PipelineParallel` plugin (strategies/pipeline/plugin.py) and by
``trainer.config.validate``. The conditions on micro-batches are those of the schedules in
``torch.distributed.pipelining`` (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Literal, get_args

PPSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV", "DualPipeV"]
SCHEDULES: tuple[str, ...] = get_args(PPSchedule)
SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank
# Schedules that run backward as separate input and weight passes (a mixture of experts counts its
# router statistics in the backward that reaches the gate's weight gradient: `trainer.models.moe`).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBV", "DualPipeV")
V_SHAPED = ("ZBV", "DualPipeV")  # two stages per rank: rank r holds stages r and 2 pp - 1 - r


def stages_per_rank_of(schedule: str, stages_per_rank: int | None) -> int:
    """Stages each rank runs: the given number, else 1 for GPipe/1F1B and 2 for the others."""
    if stages_per_rank is not None:
        return stages_per_rank
    return 1 if schedule in SINGLE_STAGE else 2


def stage_layers(n_layers: int, num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """The global layer indices of each stage.

    Balanced by layer count (the first ``n_layers % num_stages`` stages get one more) unless
    ``split_points`` gives the first layer of every stage but the first.

    Raises:
        ValueError: more stages than layers, or split points that are not increasing in (0, n_layers).
    """
    if split_points is not None:
        points = [0, *split_points, n_layers]
        if len(points) != num_stages + 1 or any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(
                f"split points {list(split_points)} must be {num_stages - 1} increasing layer indices in (0, {n_layers})"
            )
        return [range(a, b) for a, b in zip(points, points[1:])]
    if num_stages > n_layers:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers, the model has {n_layers}")
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (s < extra) for s in range(num_stages)]
    starts = accumulate(sizes[:-1], initial=0)
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def balanced_split_points(
    block_costs: Sequence[float], num_stages: int, *, first: float = 0.0, last: float = 0.0
) -> list[int]:
    """Split points (first layer of every stage but the first) minimising the costliest stage.

    Stages are contiguous runs of at least one block; the first stage also pays ``first`` (the
    embedding) and the last ``last`` (final norm, output head and loss). Exact, by dynamic
    programming over (stage, last layer), O(num_stages x n_layers^2): first the smallest possible
    maximum, then, among the splits that reach it, the one with the smallest sum of squared stage
    costs (the most even), ties going to larger early stages, so equal costs give exactly the
    layer-count split of `stage_layers`.

    Raises:
        ValueError: more stages than blocks.
    """
    n = len(block_costs)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers, the model has {n}")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:  # layers [start, end) on ``stage``
        return prefix[end] - prefix[start] + first * (stage == 0) + last * (stage == num_stages - 1)

    def solve(score, combine, cap: float) -> tuple[float, list[int]]:
        # best[s][j]: the best score of stages 0..s holding layers [0, j); cut[s][j]: where stage s starts.
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages)]
        cut = [[0] * (n + 1) for _ in range(num_stages)]
        for j in range(1, n + 1):
            if cost(0, 0, j) <= cap:
                best[0][j] = score(cost(0, 0, j))
        for s in range(1, num_stages):
            for j in range(s + 1, n + 1):
                for i in range(s, j):
                    c = cost(s, i, j)
                    if c <= cap and best[s - 1][i] < inf:
                        value = combine(best[s - 1][i], score(c))
                        if value <= best[s][j] * (1 + 1e-12):  # <=: the latest start wins a tie
                            best[s][j], cut[s][j] = value, i
        points, j = [], n
        for s in range(num_stages - 1, 0, -1):
            j = cut[s][j]
            points.append(j)
        return best[num_stages - 1][n], points[::-1]

    smallest_max, _ = solve(lambda c: c, max, float("inf"))
    _, points = solve(lambda c: c * c, lambda a, b: a + b, smallest_max * (1 + 1e-9))
    return points


def stage_owner(stage: int, *, pp: int, schedule: str) -> int:
    """The pp rank that runs ``stage``: looped (stage mod pp) or, for V schedules, a V."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def local_stages(pp_rank: int, *, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices rank ``pp_rank`` runs, in increasing order."""
    num_stages = pp * stages_per_rank
    return [s for s in range(num_stages) if stage_owner(s, pp=pp, schedule=schedule) == pp_rank]


def microbatch_problems(schedule: str, *, pp: int, stages_per_rank: int, num_microbatches: int) -> list[str]:
    """What ``num_microbatches`` per schedule step lacks for ``schedule`` (torch's own conditions)."""
    m, num_stages = num_microbatches, pp * stages_per_rank
    fix = "use more micro-batches per schedule step (strategy.pipeline.num_microbatches, or a smaller train.micro_batch_size)"
    if schedule == "1F1B" and m < pp:
        return [
            f"strategy.pipeline.schedule=1F1B needs at least pp={pp} micro-batches per schedule step, got {m}; {fix}"
        ]
    if schedule == "DualPipeV" and m < num_stages:
        return [
            f"strategy.pipeline.schedule=DualPipeV needs at least 2 x pp={num_stages} micro-batches per schedule step, got {m}; {fix}"
        ]
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
        rounds = max(1, m // pp)
        return [
            f"strategy.pipeline.schedule={schedule} runs micro-batches in rounds of pp={pp}: {m} micro-batches per schedule "
            f"step is not a multiple of its {rounds} rounds; use {rounds * pp} or another multiple of pp"
        ]
    return []


def check_pipeline(
    *,
    pp: int,
    schedule: str,
    stages_per_rank: int | None,
    split_points: Sequence[int] | None,
    num_microbatches: int | None,
    microbatches_per_step: int | None,
    n_layers: int,
    tie_embeddings: bool = False,
    split: str = "layers",
) -> list[str]:
    """Problems of a pipeline layout, each naming its fix; [] when it runs (or pp == 1).

    Args:
        microbatches_per_step: micro-batches of one optimizer step on one rank (global batch /
            (dp x micro_batch_size)); None when unknown.
    """
    if pp == 1:
        return []
    if schedule not in SCHEDULES:
        return [f"strategy.pipeline.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}"]
    problems: list[str] = []
    v = stages_per_rank_of(schedule, stages_per_rank)
    if v < 1:
        return [f"strategy.pipeline.stages_per_rank={v} must be >= 1 (or null for the schedule's default)"]
    if schedule in SINGLE_STAGE and v != 1:
        problems.append(
            f"strategy.pipeline.schedule={schedule} runs one stage per rank, got strategy.pipeline.stages_per_rank={v}; "
            f"use strategy.pipeline.stages_per_rank=null or an interleaved schedule (strategy.pipeline.schedule=Interleaved1F1B)"
        )
    if schedule in V_SHAPED and v != 2:
        problems.append(
            f"strategy.pipeline.schedule={schedule} runs exactly 2 stages per rank (a V), got strategy.pipeline.stages_per_rank={v}; "
            f"use strategy.pipeline.stages_per_rank=null"
        )
    num_stages = pp * v
    if split_points is None and pp <= n_layers < num_stages:  # pp > n_layers: reported by ParallelDims
        problems.append(
            f"strategy.pp={pp} x {v} stages per rank = {num_stages} stages exceeds model.n_layers={n_layers}; "
            f"use model.n_layers >= {num_stages} or a smaller strategy.pp"
            + (" or one stage per rank (strategy.pipeline.schedule=1F1B)" if v > 1 else "")
        )
    if split not in ("layers", "auto"):
        problems.append(
            f"strategy.pipeline.split={split!r} is unknown; use layers (by layer count) or auto (by predicted cost)"
        )
    elif split == "auto" and split_points is not None:
        problems.append(
            "strategy.pipeline.split=auto chooses the split points itself; use strategy.pipeline.split_points=null "
            "or strategy.pipeline.split=layers"
        )
    if split_points is not None:
        try:
            stage_layers(n_layers, num_stages, split_points)
        except ValueError as err:
            problems.append(f"strategy.pipeline.split_points: {err}; give {num_stages - 1} points or null (balanced)")
    if tie_embeddings:
        problems.append(
            "model.tie_embeddings=true cannot be split over pipeline stages (the input embedding and the output head "
            "live on the first and last stage); use model.tie_embeddings=false or strategy.pp=1"
        )
    if num_microbatches is not None and num_microbatches < 1:
        problems.append(
            f"strategy.pipeline.num_microbatches={num_microbatches} must be >= 1 (or null: all of the step's)"
        )
        return problems
    if microbatches_per_step is not None:
        m = num_microbatches or microbatches_per_step
        if microbatches_per_step % m:
            problems.append(
                f"the {microbatches_per_step} micro-batches of a step (train.global_batch_size / (dp x "
                f"train.micro_batch_size)) are not a multiple of strategy.pipeline.num_microbatches={m}; "
                f"use a divisor of {microbatches_per_step}"
            )
        problems += microbatch_problems(schedule, pp=pp, stages_per_rank=v, num_microbatches=m)
    return problems
