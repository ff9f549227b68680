"""Where a global rank sits in a layout: its mesh coordinates, its pipeline stages, the parameter
tensors it keeps (alike blocks counted once) and its shard of each (`strategies.planner.memory`
and `strategies.planner.time` count a rank's bytes and time from these).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from strategies.core.shape import ModelShape, ParamSpec
from strategies.pipeline.layout import local_stages, stage_layers
from strategies.planner.layout import Layout


def rank_coords(layout: Layout, rank: int) -> dict[str, int]:
    """This global rank's index on each mesh axis (pp, dp_replicate, dp_shard, cp, tp; row-major)."""
    coords, rest = {}, rank
    for axis in reversed(("pp", "dp_replicate", "dp_shard", "cp", "tp")):
        size = getattr(layout, axis)
        coords[axis], rest = rest % size, rest // size
    return coords


def stage_plan(shape: ModelShape, layout: Layout, pp_rank: int) -> tuple[list[int], list[range], int]:
    """(this rank's stages, layers of every stage, number of stages)."""
    num_stages = layout.pp * layout.stages_per_rank
    stages = local_stages(pp_rank, pp=layout.pp, stages_per_rank=layout.stages_per_rank, schedule=layout.pp_schedule)
    return stages, stage_layers(shape.n_layers, num_stages, layout.split_points), num_stages


def checkpointed_layers(shape: ModelShape, layout: Layout) -> frozenset[int]:
    """The blocks run under activation checkpointing: all with ``ac="full"``; with ``"every_k"``
    every k-th of each pp rank's blocks, counted from its first in layer order (its stages
    together). `strategies.activation_checkpoint.apply_activation_checkpointing` numbers the
    blocks of the model it is given, which under pipeline parallelism keeps only its rank's
    stages: with k=2 a rank holding layers 3..7 checkpoints 3, 5 and 7, not 4 and 6."""
    if layout.ac == "full":
        return frozenset(range(shape.n_layers))
    if layout.ac != "every_k":
        return frozenset()
    chosen: set[int] = set()
    for pp_rank in range(layout.pp):
        stages, layers, _ = stage_plan(shape, layout, pp_rank)
        chosen.update(sorted(i for s in stages for i in layers[s])[:: layout.ac_every_k])
    return frozenset(chosen)


def rank_params(shape: ModelShape, layout: Layout, pp_rank: int) -> list[ParamSpec]:
    """The parameter tensors a pp rank keeps."""
    if layout.pp == 1:
        return list(shape.params)
    stages, layers, num_stages = stage_plan(shape, layout, pp_rank)
    keep = {i for s in stages for i in layers[s]}
    first, last = 0 in stages, num_stages - 1 in stages
    out = []
    for p in shape.params:
        if p.layer is not None:
            if p.layer in keep:
                out.append(p)
        elif p.name.startswith("tok_embeddings") and first or not p.name.startswith("tok_embeddings") and last:
            out.append(p)
    return out


def rank_param_counts(shape: ModelShape, layout: Layout, pp_rank: int) -> list[tuple[ParamSpec, int]]:
    """`rank_params` with alike blocks counted once (`ModelShape.block_kinds`): ``(a tensor of one
    block of each kind, how many of the rank's blocks are of that kind)``, and the embedding, final
    norm and head it keeps with 1. What the planner sums over a rank's tensors, in integers, is
    the same over either list."""
    kind_of, kinds = shape.block_kinds
    roots = shape.params_of_layer.get(None, ())
    if layout.pp == 1:
        keep: Iterable[int] = kind_of
    else:
        stages, layers, num_stages = stage_plan(shape, layout, pp_rank)
        keep = {i for s in stages for i in layers[s]}
        first, last = 0 in stages, num_stages - 1 in stages
        roots = tuple(p for p in roots if (p.name.startswith("tok_embeddings") and first) or
                      (not p.name.startswith("tok_embeddings") and last))  # fmt: skip
    counts = Counter(kind_of[i] for i in keep if i in kind_of)
    return [(p, 1) for p in roots] + [(p, n) for kind, n in sorted(counts.items()) for p in kinds[kind]]


def local_numel(p: ParamSpec, layout: Layout, shard_index: int) -> tuple[int, int]:
    """(elements of this rank's shard, elements of its padded storage) of one parameter.

    TP splits ``p.tp_dim`` evenly; FSDP2 then chunks dim 0 over ``layout.fsdp_shards`` ranks
    (``torch.chunk`` sizes: ceil(rows / shards) each, the last ones shorter or empty) and pads
    every rank's storage to the first chunk's size.
    """
    dims = list(p.shape)
    if layout.tp > 1 and p.tp_dim is not None:
        dims[p.tp_dim] //= layout.tp
    rest = math.prod(dims[1:])
    shards = layout.fsdp_shards if layout.uses_fsdp else 1
    if shards == 1:
        n = math.prod(dims)
        return n, n
    chunk = -(-dims[0] // shards)
    rows = max(0, min(chunk, dims[0] - shard_index * chunk))
    return rows * rest, chunk * rest


def rank_of(layout: Layout, **coords: int) -> int:
    """The global rank at the given mesh coordinates (others 0)."""
    rank = 0
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        rank = rank * getattr(layout, axis) + coords.get(axis, 0)
    return rank
