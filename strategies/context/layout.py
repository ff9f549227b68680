"""This rank's context-parallel process groups: the cp group, its Ulysses head groups and its ring.

`build_cp_layout` creates them for every cp group of the mesh (ring, Ulysses or hybrid head x
context, `strategies.context.plugin`); `build_sub_layouts` creates, once at setup, the same for the
aligned sub-groups of 2, 4, ... ranks of every cp group, among which hybrid placement
(`strategies.context.placement`) splits a row over the smallest that fits it. ``new_group`` is
collective over the default group: every rank creates every group, in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from strategies.context.ring import Ring


@dataclass(frozen=True)
class CPLayout:
    """This rank's context-parallel groups.

    Args:
        cp: ranks in the cp group; ``index``: this rank's place in it.
        cp_group: the whole cp group (gathers document ids).
        ulysses_degree: ranks of one head group; ``ulysses_group`` their group (None if 1).
        ring: the ring across head groups (one member when ``cp == ulysses_degree``).
    """

    cp: int
    index: int
    cp_group: dist.ProcessGroup
    ulysses_degree: int
    ulysses_group: dist.ProcessGroup | None
    ring: Ring


def build_cp_layout(cp_ranks: list[list[int]], *, ulysses_degree: int) -> CPLayout:
    """Creates the cp, Ulysses and ring groups of every cp group; returns this rank's.

    Args:
        cp_ranks: the global ranks of every cp group of the mesh, each in cp order. Every rank
            must pass the same lists: ``new_group`` is collective over the default group.
        ulysses_degree: ranks per head group; divides the cp degree.

    Raises:
        ValueError: ``ulysses_degree`` does not divide the cp degree, or this rank is in no group.
    """
    me = dist.get_rank()
    cp = len(cp_ranks[0])
    if cp % ulysses_degree:
        raise ValueError(f"ulysses_degree={ulysses_degree} does not divide cp={cp}")
    mine: dict = {}
    for ranks in cp_ranks:
        group = dist.new_group(ranks)
        rings = [ranks[j::ulysses_degree] for j in range(ulysses_degree)]
        heads = [ranks[i : i + ulysses_degree] for i in range(0, cp, ulysses_degree)]
        ring_groups = [dist.new_group(r) if len(r) > 1 else None for r in rings]
        head_groups = [dist.new_group(h) if len(h) > 1 else None for h in heads]
        if me in ranks:
            index = ranks.index(me)
            ring_ranks = rings[index % ulysses_degree]
            mine = {
                "cp": cp, "index": index, "cp_group": group, "ulysses_degree": ulysses_degree,
                "ulysses_group": head_groups[index // ulysses_degree],
                "ring": Ring(ring_groups[index % ulysses_degree], tuple(ring_ranks), ring_ranks.index(me)),
            }  # fmt: skip
    if not mine:
        raise ValueError(f"rank {me} is in none of the cp groups {cp_ranks}")
    return CPLayout(**mine)


def build_sub_layouts(cp_ranks: list[list[int]], sizes: tuple[int, ...], *, ulysses_degree: int) -> dict[int, CPLayout]:
    """This rank's layout in each cp sub-group size: ``{g: CPLayout}`` for every ``1 < g < cp`` of ``sizes``.

    A sub-group of size ``g`` is an aligned block ``ranks[i g : (i + 1) g]`` of a cp group (cp
    index ``c`` is in block ``c // g`` at index ``c % g``). Its attention runs in the mode of the
    whole group, restricted to it: ``gcd(ulysses_degree, g)`` ranks per head group (the ring: 1;
    Ulysses: ``g``; hybrid: the head groups inside the block) and a ring over the rest. The heads
    split evenly whenever they do over ``ulysses_degree``, since that gcd divides it.

    Args:
        cp_ranks: the global ranks of every cp group, each in cp order (the same on every rank).
        sizes: sub-group sizes; each must divide the cp degree (1 and cp are skipped).
        ulysses_degree: ranks per head group of the whole cp group.

    Raises:
        ValueError: a size does not divide the cp degree.
    """
    cp = len(cp_ranks[0])
    layouts = {}
    for g in sizes:
        if g in (1, cp):
            continue
        if cp % g:
            raise ValueError(f"cp sub-group size {g} does not divide cp={cp}")
        blocks = [ranks[i : i + g] for ranks in cp_ranks for i in range(0, cp, g)]
        layouts[g] = build_cp_layout(blocks, ulysses_degree=math.gcd(ulysses_degree, g))
    return layouts
