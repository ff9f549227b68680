"""Least-loaded expert parallelism (LLEP): every step, the rows above a capacity on the most loaded
ep ranks go, with copies of their experts' weights, to the least loaded ranks.

Source: Nguyen et al. 2026, "LLEP: Least-Loaded Expert Parallelism" (arXiv 2601.17111;
SalesforceAIResearch/LeastLoadedEP), read for the method, not copied. Trained routers stay uneven,
so under standard expert parallelism (`strategies.expert.dispatch.AllToAllDispatch`) the rank that
owns a popular expert computes far more rows than the mean, and its step time and activation
memory set everyone's. LLEP keeps the maths of standard EP (each row still meets its own expert's
weights), and so its outputs and gradients, while bounding each rank's rows:

1. all-gather the rows every rank routes to every expert (``[R, E]``);
2. plan (`plan_spills`, the same on every rank): owners keep their experts' rows up to
   ``capacity = max(floor(ratio * mean), ceil(mean))`` rows per rank; from the most loaded rank
   and its most loaded expert down (longest-processing-time first), the excess goes to the
   currently least loaded rank, never in pieces below ``min_tokens_per_gemm`` rows;
3. the rows travel by one all-to-all to the rank that computes them, the spilled experts'
   weights point to point from owner to helper (`_LendExperts`), and in backward the helpers send
   those weights' gradients back to the owners, which add them to their own.

A rank's rows are at most the capacity (so max / mean <= ratio) unless a needed move would be
smaller than ``min_tokens_per_gemm`` (then by less than that many rows).

Shape suffixes: M routed rows, D model dim, E experts, R ep ranks, J experts per rank, I GEMM groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from strategies.expert.dispatch import counts_load, local_weights, source_major_to_expert_major


@dataclass(frozen=True)
class SpillPlan:
    """Who computes which rows of each expert.

    ``items[r]``: rank r's GEMM groups ``(expert, start, stop)``: rows ``start..stop-1`` of the
    expert's rows over all ranks in source-rank order; first r's own J experts (the rows they
    keep, possibly none), then the experts lent to r in expert order.
    """

    items: tuple[tuple[tuple[int, int, int], ...], ...]
    experts_per_rank: int

    def rank_loads(self) -> list[int]:
        """Rows each rank computes."""
        return [sum(stop - start for _, start, stop in items) for items in self.items]

    def lent(self, rank: int) -> list[tuple[int, int]]:
        """``(expert, helper)`` of ``rank``'s experts computed elsewhere too, ordered by helper then expert."""
        J = self.experts_per_rank
        out = [(e, h) for h, items in enumerate(self.items) for e, _, _ in items[J:] if e // J == rank]
        return sorted(out, key=lambda eh: (eh[1], eh[0]))

    def borrowed(self, rank: int) -> list[tuple[int, int]]:
        """``(expert, owner)`` of the experts lent to ``rank``, in its GEMM-group order."""
        return [(e, e // self.experts_per_rank) for e, _, _ in self.items[rank][self.experts_per_rank :]]


def plan_spills(counts_re: list[list[int]], *, capacity_ratio: float, min_tokens_per_gemm: int) -> SpillPlan:
    """The LLEP plan from the rows each rank routes to each expert (``counts_re[r][e]``).

    Raises:
        ValueError: ``capacity_ratio < 1``, or the ranks do not divide the experts.
    """
    R, E = len(counts_re), len(counts_re[0])
    if capacity_ratio < 1 or E % R:
        raise ValueError(f"capacity_ratio={capacity_ratio} must be >= 1 and the {R} ranks must divide {E} experts")
    J = E // R
    load_e = [sum(row[e] for row in counts_re) for e in range(E)]
    rank_load = [sum(load_e[r * J : (r + 1) * J]) for r in range(R)]
    total = sum(load_e)
    capacity = max(math.floor(capacity_ratio * total / R), math.ceil(total / R))
    keep = list(load_e)
    lent: list[list[tuple[int, int, int]]] = [[] for _ in range(R)]
    for r in sorted(range(R), key=lambda q: -rank_load[q]):
        for e in sorted(range(r * J, (r + 1) * J), key=lambda q: -keep[q]):
            while rank_load[r] > capacity and keep[e] > 0:
                helper = min((q for q in range(R) if q != r), key=lambda q: (rank_load[q], q))
                amount = min(rank_load[r] - capacity, capacity - rank_load[helper], keep[e])
                if amount <= 0 or amount < min_tokens_per_gemm:
                    break
                # The owner keeps the first rows; each spill takes the last rows it still keeps.
                lent[helper].append((e, keep[e] - amount, keep[e]))
                keep[e] -= amount
                rank_load[r] -= amount
                rank_load[helper] += amount
    items = tuple(tuple((e, 0, keep[e]) for e in range(r * J, (r + 1) * J)) + tuple(sorted(lent[r])) for r in range(R))
    return SpillPlan(items=items, experts_per_rank=J)


def _p2p(
    group: dist.ProcessGroup, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
) -> None:
    """Point-to-point sends and receives (peers are ranks of ``group``), all in flight at once."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=p) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=p) for p, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _LendExperts(torch.autograd.Function):
    """Forward: owners send the weights of their spilled experts to the helpers, which return
    them stacked ``[n, out, in]`` per projection. Backward: the helpers send the gradients of those
    copies back, and each owner adds them to its own experts' gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        lent: list[tuple[int, int]],
        borrowed: list[tuple[int, int]],
        J: int,
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.lent, ctx.borrowed, ctx.J = group, lent, borrowed, J
        ctx.shapes = [w.shape[1:] for w in weights]
        sends = [(h, torch.cat([w[e % J].reshape(-1) for w in weights])) for e, h in lent]
        numel = sum(math.prod(s) for s in ctx.shapes)
        recvs = [(o, weights[0].new_empty(numel)) for _, o in borrowed]
        _p2p(group, sends, recvs)
        return tuple(
            torch.stack([_unpack(buf, ctx.shapes)[i] for _, buf in recvs])
            if recvs
            else weights[i].new_empty(0, *ctx.shapes[i])
            for i in range(len(weights))
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        J, shapes = ctx.J, ctx.shapes
        sends = [(o, torch.cat([g[k].reshape(-1) for g in grads])) for k, (_, o) in enumerate(ctx.borrowed)]
        numel = sum(math.prod(s) for s in shapes)
        recvs = [(h, grads[0].new_empty(numel)) for _, h in ctx.lent]
        _p2p(ctx.group, sends, recvs)
        local = [grads[0].new_zeros(J, *s) for s in shapes]
        for (e, _), (_, buf) in zip(ctx.lent, recvs):
            for out, part in zip(local, _unpack(buf, shapes)):
                out[e % J] += part
        return (None, None, None, None, *local)


def _unpack(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    parts = flat.split([math.prod(s) for s in shapes])
    return [p.view(s) for p, s in zip(parts, shapes)]


def _overlap(a: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    return max(a, lo), min(b, hi)


class LeastLoadedDispatch:
    """Expert parallelism with LLEP's spilling (see the module docstring).

    Args:
        group: the ep process group (experts ``r*J .. r*J+J-1`` live on its rank r).
        capacity_ratio: rows per rank at most this multiple of the mean (>= 1).
        min_tokens_per_gemm: no spill smaller than this many rows.

    Records, per call, the rows each rank computes with and without the spills (``[R]`` each;
    see `pop_rank_loads`).
    """

    def __init__(self, group: dist.ProcessGroup, *, capacity_ratio: float = 1.1, min_tokens_per_gemm: int = 16) -> None:
        self.group, self.ep, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.capacity_ratio, self.min_tokens_per_gemm = capacity_ratio, min_tokens_per_gemm
        self.rank_loads: list[torch.Tensor] = []
        self.owner_loads: list[torch.Tensor] = []

    def pop_rank_loads(self) -> torch.Tensor | None:
        """``[calls, R]`` rows computed per ep rank since the last pop, or None."""
        loads, self.rank_loads, self.owner_loads = self.rank_loads, [], []
        return torch.stack(loads) if loads else None

    def __call__(self, x_md: torch.Tensor, counts_e: torch.Tensor, experts: Any) -> torch.Tensor:
        gathered = [torch.empty_like(counts_e) for _ in range(self.ep)]
        dist.all_gather(gathered, counts_e.contiguous(), group=self.group)
        counts_re = torch.stack(gathered).tolist()
        plan = plan_spills(counts_re, capacity_ratio=self.capacity_ratio, min_tokens_per_gemm=self.min_tokens_per_gemm)
        J = plan.experts_per_rank
        if counts_load():
            self.rank_loads.append(torch.tensor(plan.rank_loads()))
            self.owner_loads.append(
                torch.tensor([sum(sum(row[r * J : (r + 1) * J]) for row in counts_re) for r in range(self.ep)])
            )

        send_idx, send, recv_ri = self._routes(counts_re, plan)
        index = torch.tensor(send_idx, dtype=torch.long, device=x_md.device)
        recv = [sum(row) for row in recv_ri]
        x_recv = funcol.all_to_all_single_autograd(x_md[index], recv, send, self.group)
        recv_ri_t = torch.tensor(recv_ri, dtype=torch.long, device=x_md.device).view(self.ep, -1)
        order = source_major_to_expert_major(recv_ri_t)
        weights = local_weights(experts)
        if any(items[J:] for items in plan.items):
            # Every rank takes part (lending, borrowing or neither) so that all ranks' backward
            # graphs have the same shape and run the point-to-point exchanges in the same order.
            copies = _LendExperts.apply(self.group, plan.lent(self.rank), plan.borrowed(self.rank), J, *weights)
            weights = tuple(torch.cat([w, c]) for w, c in zip(weights, copies))
        y = experts.compute(x_recv[order], recv_ri_t.sum(0), weights)
        y_recv = torch.empty_like(y).index_copy(0, order, y) if y.numel() else y
        y_sent = funcol.all_to_all_single_autograd(y_recv, send, recv, self.group)
        return torch.empty_like(y_sent).index_copy(0, index, y_sent) if y_sent.numel() else y_sent

    def _routes(self, counts_re: list[list[int]], plan: SpillPlan) -> tuple[list[int], list[int], list[list[int]]]:
        """This rank's rows in send order (by destination rank, then its GEMM groups), the rows sent
        to each rank, and ``recv_ri[s][i]`` rows rank s sends for this rank's group i."""
        R, E, me = self.ep, len(counts_re[0]), self.rank
        # Where each rank's rows for expert e start in e's rows over all ranks (source order).
        before = [[sum(counts_re[q][e] for q in range(s)) for e in range(E)] for s in range(R)]
        local_start = [sum(counts_re[me][:e]) for e in range(E)]
        send_idx, send = [], [0] * R
        for r in range(R):
            for e, a, b in plan.items[r]:
                lo, hi = _overlap(a, b, before[me][e], before[me][e] + counts_re[me][e])
                if hi > lo:
                    first = local_start[e] + lo - before[me][e]
                    send_idx.extend(range(first, first + hi - lo))
                    send[r] += hi - lo
        recv_ri = [
            [max(0, min(b, before[s][e] + counts_re[s][e]) - max(a, before[s][e])) for e, a, b in plan.items[me]]
            for s in range(R)
        ]
        return send_idx, send, recv_ri
