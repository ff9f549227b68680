"""Ring attention: exact attention over key/value blocks passed around a ring of ranks.

Sources: Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(key/value blocks rotate around the ring while each rank keeps its queries); Milakov & Gimelshein
2018, "Online normalizer calculation for softmax", and Dao et al. 2022, "FlashAttention" (partial
results merged with their log-sum-exp; the backward recomputes the probabilities from the saved
log-sum-exp instead of saving them). The per-block kernels are `strategies.context.attention_blocks`
(fused on CUDA, eager fp32 on CPU).

Which key a query may attend is given by *positions* and *document ids*, not by the order of the
tokens in memory: query at position p attends key at position s iff ``s <= p`` and both carry the
same document id. So any sharding of the sequence works (contiguous, load-balanced zigzag, or the
concatenated shards a Ulysses all-to-all produces), and packed rows never attend across documents,
also when a document straddles two shards.

Memory: the forward saves q, k, v, the output and the log-sum-exp (O(T) per rank); the
``[Tq, chunk]`` score blocks are recomputed in the backward. Communication: each step sends this
rank's current k/v block to the next rank (overlapped with the block's compute); the backward
sends k/v and their gradient accumulators the same way, so each k/v gradient ends on its owner.

Shape suffixes: B batch, K key/value heads, R query heads per kv head (GQA), Q/S query/key tokens,
E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.context.attention_blocks import NEG_INF, EagerBlocks, FusedBlocks, block_kernels, finite


@dataclass(frozen=True)
class Ring:
    """The ranks a k/v block travels through, and this rank's place among them.

    Args:
        group: process group of the ring (None for a ring of one rank: no communication).
        ranks: global ranks in ring order.
        index: this rank's position in ``ranks``.
    """

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def start_pass(self, tensor: torch.Tensor) -> "_Pending":
        """Starts sending ``tensor`` to the next rank and receiving the previous rank's; wait() on the result."""
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        nxt, prv = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        ops = [dist.P2POp(dist.isend, tensor, nxt, self.group), dist.P2POp(dist.irecv, out, prv, self.group)]
        return _Pending(out, dist.batch_isend_irecv(ops))


@dataclass
class _Pending:
    out: torch.Tensor
    requests: list

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.out


@dataclass(frozen=True)
class RingMasks:
    """Positions and document ids of this rank's queries and of each ring member's keys.

    Args:
        pos_q: ``[Q]`` int positions of the local queries in the full row.
        doc_q: ``[B, Q]`` document ids of the local queries, or None (one document per row).
        pos_kv: per ring index, ``[S]`` positions of that member's keys.
        doc_kv: per ring index, ``[B, S]`` document ids of its keys, or None.
        pos_kv_host: ``pos_kv`` on the host, to skip blocks without a device synchronisation
            (None: the positions are host tensors already).
        last_query: the largest position in ``pos_q`` (read with ``pos_kv_host``).
    """

    pos_q: torch.Tensor
    doc_q: torch.Tensor | None
    pos_kv: tuple[torch.Tensor, ...]
    doc_kv: tuple[torch.Tensor, ...] | None
    pos_kv_host: tuple[torch.Tensor, ...] | None = None
    last_query: int = -1

    def allowed(self, src: int, start: int, stop: int) -> torch.Tensor:
        """Boolean ``[B or 1, 1, 1, Q, stop - start]``: may query q attend key s of member ``src``."""
        pos_k = self.pos_kv[src][start:stop]
        mask_qs = pos_k[None, :] <= self.pos_q[:, None]
        if self.doc_q is None:
            return mask_qs[None, None, None]
        doc_k = self.doc_kv[src][:, start:stop]
        mask_bqs = mask_qs[None] & (self.doc_q[:, :, None] == doc_k[:, None, :])
        return mask_bqs[:, None, None]

    def live(self, src: int, start: int, stop: int, allowed: torch.Tensor) -> bool:
        """Whether the block has any allowed pair; on an accelerator from positions alone (no sync)."""
        if self.pos_kv_host is None:
            return bool(allowed.any())
        return int(self.pos_kv_host[src][start:stop].min()) <= self.last_query


def _chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    step = chunk if chunk > 0 else length
    return [(a, min(a + step, length)) for a in range(0, length, step)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, masks: RingMasks, scale: float, kv_chunk: int, blocks):  # noqa: ANN001
        B, K, R, Q, E = q.shape
        out = torch.zeros(B, K, R, Q, E, dtype=torch.float32, device=q.device)
        lse = torch.full((B, K, R, Q), NEG_INF, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            src = (ring.index - step) % ring.size
            pending = ring.start_pass(kv) if step < ring.size - 1 else None
            for a, b in _chunks(kv.shape[3], kv_chunk):
                mask = masks.allowed(src, a, b)
                if not masks.live(src, a, b, mask):  # e.g. a block wholly in this rank's future
                    continue
                out_b, lse_b = blocks.forward(q, kv[0, :, :, a:b], kv[1, :, :, a:b], mask, scale)
                new = torch.logaddexp(lse, lse_b)
                safe = finite(new)
                out = out * torch.exp(lse - safe)[..., None] + out_b.float() * torch.exp(lse_b - safe)[..., None]
                lse = new
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.masks, ctx.scale, ctx.kv_chunk, ctx.blocks = ring, masks, scale, kv_chunk, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        ring, masks, scale, blocks = ctx.ring, ctx.masks, ctx.scale, ctx.blocks
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with kv to its owner
        for step in range(ring.size):
            src = (ring.index - step) % ring.size
            pending = ring.start_pass(kv) if step < ring.size - 1 else None
            for a, b in _chunks(kv.shape[3], ctx.kv_chunk):
                mask = masks.allowed(src, a, b)
                if not masks.live(src, a, b, mask):
                    continue
                dq_b, dk_b, dv_b = blocks.backward(
                    grad_out, q, kv[0, :, :, a:b], kv[1, :, :, a:b], mask, out, lse, scale
                )
                dq += dq_b
                dkv[0, :, :, a:b] += dk_b
                dkv[1, :, :, a:b] += dv_b
            if pending is not None:
                kv = pending.wait()
            if ring.size > 1:
                dkv = ring.start_pass(dkv).wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q_bkrqe: torch.Tensor,
    k_bkse: torch.Tensor,
    v_bkse: torch.Tensor,
    *,
    ring: Ring,
    masks: RingMasks,
    scale: float | None = None,
    kv_chunk: int = 0,
    blocks: EagerBlocks | FusedBlocks | None = None,
) -> torch.Tensor:
    """Exact (block-diagonal) causal attention of local queries over the keys of every ring member.

    Args:
        q_bkrqe: local queries ``[B, K, R, Q, E]``: query head ``k * R + r`` is served by kv head k (GQA).
        k_bkse, v_bkse: local keys and values ``[B, K, S, E]``; every ring member holds S tokens.
        ring: the ranks the k/v blocks travel through (every member calls this with its own blocks).
        masks: positions and document ids of the queries and of each member's keys.
        scale: score scale (default ``E ** -0.5``).
        kv_chunk: keys per score block (0: the whole k/v block); bounds the ``[Q, chunk]``
            temporaries (scores, or the fused kernels' bias), not the saved memory.
        blocks: the block kernels (`strategies.context.attention_blocks`); None: fused on CUDA, eager fp32
            elsewhere.

    Returns:
        ``[B, K, R, Q, E]`` attention output in the dtype of ``q``; blocks merged in fp32 (eager
        blocks also compute scores and softmax in fp32, under autocast too).
    """
    scale = q_bkrqe.shape[-1] ** -0.5 if scale is None else scale
    blocks = block_kernels(q_bkrqe.device) if blocks is None else blocks
    return _RingAttention.apply(q_bkrqe, k_bkse, v_bkse, ring, masks, scale, kv_chunk, blocks)
