"""Attention of one query block over one key block, returning the log-sum-exp: ring attention's kernels.

Sources: Dao et al. 2022, "FlashAttention" (a block's output and log-sum-exp are enough to merge
it with other blocks; its backward recomputes the probabilities from the *global* log-sum-exp and
takes ``delta = rowsum(dout * out)`` of the global output, so each block's backward is the fused
backward kernel called with the merged output and log-sum-exp); Rabe & Staats 2021,
"Self-attention Does Not Need O(n^2) Memory" (the memory-efficient kernel used on CUDA).

Two implementations of the same two calls, chosen by device (`block_kernels`):

- `EagerBlocks` (CPU, gloo): scores and softmax in fp32 eager code, autocast off, so a bf16 run
  computes its forward in the same precision as its backward.
- `FusedBlocks`: the fused SDPA kernels that return the log-sum-exp (CUDA: memory-efficient
  attention with an additive bias; CPU: the flash CPU kernel, used by the tests to check the
  code shared with CUDA). GQA folds the R query heads of each kv head into the query length,
  so no k/v copies are made.

Shape suffixes: B batch, K key/value heads, R query heads per kv head, Q/S query/key tokens, E head dim.
``allowed`` is a boolean ``[B or 1, 1, 1, Q, S]`` mask of the block (``RingMasks.allowed``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows without any allowed key) replaced by 0, so ``exp(s - lse)`` stays 0, not NaN."""
    return lse.masked_fill(lse == NEG_INF, 0.0)


class EagerBlocks:
    """fp32 eager block kernels (the CPU/gloo path); every op runs with autocast off."""

    def forward(
        self, q_bkrqe: torch.Tensor, k_bkse: torch.Tensor, v_bkse: torch.Tensor, allowed: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out ``[B, K, R, Q, E]`` fp32, lse ``[B, K, R, Q]`` fp32, -inf where no key is allowed)."""
        with torch.autocast(q_bkrqe.device.type, enabled=False):
            s = self._scores(q_bkrqe, k_bkse, allowed, scale)
            lse = torch.logsumexp(s, dim=-1)
            out = torch.matmul(torch.exp(s - finite(lse)[..., None]), v_bkse.float()[:, :, None])
        return out, lse

    def backward(
        self,
        dout: torch.Tensor,
        q_bkrqe: torch.Tensor,
        k_bkse: torch.Tensor,
        v_bkse: torch.Tensor,
        allowed: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's share of (dq ``[B, K, R, Q, E]``, dk, dv ``[B, K, S, E]``), fp32, from the merged out/lse."""
        with torch.autocast(q_bkrqe.device.type, enabled=False):
            dout, k, v = dout.float(), k_bkse.float()[:, :, None], v_bkse.float()[:, :, None]
            delta = (dout * out.float()).sum(-1, keepdim=True)
            p = torch.exp(self._scores(q_bkrqe, k_bkse, allowed, scale) - finite(lse)[..., None])
            dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
            ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
            dq = torch.matmul(ds, k) * scale
            dk = torch.matmul(ds.transpose(-1, -2), q_bkrqe.float()).sum(2) * scale
        return dq, dk, dv

    @staticmethod
    def _scores(q_bkrqe: torch.Tensor, k_bkse: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
        s = torch.matmul(q_bkrqe.float(), k_bkse.float()[:, :, None].transpose(-1, -2)) * scale
        return s.masked_fill(~allowed, NEG_INF)


class FusedBlocks:
    """Fused SDPA block kernels with log-sum-exp (CUDA memory-efficient attention; CPU flash kernel).

    Args:
        cuda: call the CUDA kernels (their meta kernels check shapes on a CPU-only machine).
    """

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda

    def forward(
        self, q_bkrqe: torch.Tensor, k_bkse: torch.Tensor, v_bkse: torch.Tensor, allowed: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out ``[B, K, R, Q, E]`` in q's dtype, lse ``[B, K, R, Q]`` fp32, -inf where no key is allowed)."""
        B, K, R, Q, E = q_bkrqe.shape
        q = q_bkrqe.reshape(B, K, R * Q, E)
        bias = _bias(allowed, B, K, R, q.dtype)
        if self.cuda:
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k_bkse, v_bkse, bias, True, 0.0, False, scale=scale
            )
            lse = lse[..., : R * Q]  # the kernel pads the log-sum-exp to a multiple of 32 rows
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k_bkse, v_bkse, 0.0, False, attn_mask=bias, scale=scale
            )
        any_key = allowed.any(-1).expand(B, 1, R, Q).reshape(B, 1, R * Q)
        lse = lse.float().masked_fill(~any_key, NEG_INF)
        out = out.masked_fill(~any_key[..., None], 0.0)
        return out.view(B, K, R, Q, E), lse.view(B, K, R, Q)

    def backward(
        self,
        dout: torch.Tensor,
        q_bkrqe: torch.Tensor,
        k_bkse: torch.Tensor,
        v_bkse: torch.Tensor,
        allowed: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's share of (dq ``[B, K, R, Q, E]``, dk, dv ``[B, K, S, E]``), fp32, from the merged out/lse."""
        B, K, R, Q, E = q_bkrqe.shape
        q, dout, out = (t.reshape(B, K, R * Q, E).to(q_bkrqe.dtype) for t in (q_bkrqe, dout, out))
        lse = lse.reshape(B, K, R * Q).contiguous()
        bias = _bias(allowed, B, K, R, q.dtype)
        if self.cuda:
            pad = -(R * Q) % 32
            lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
            none = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: no dropout
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k_bkse, v_bkse, bias, out, lse, none, none, 0.0, [True, True, True, False], False, scale=scale
            )
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k_bkse, v_bkse, out, lse, 0.0, False, attn_mask=bias, scale=scale
            )
        return dq.float().view(B, K, R, Q, E), dk.float(), dv.float()


def _bias(allowed: torch.Tensor, B: int, K: int, R: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias ``[B, K, R * Q, S]`` (0 / -inf, broadcast over K), last dim stored aligned to 16."""
    b, _, _, Q, S = allowed.shape
    aligned = torch.full((b, 1, R * Q, -(-S // 16) * 16), NEG_INF, dtype=dtype, device=allowed.device)
    bias = aligned[..., :S]
    bias.view(b, 1, R, Q, S).masked_fill_(allowed.expand(b, 1, R, Q, S), 0.0)
    return bias.expand(B, K, R * Q, S)


def block_kernels(device: torch.device, kernel: str = "auto") -> EagerBlocks | FusedBlocks:
    """The block kernels for ``device``: ``auto`` (fused on CUDA, eager elsewhere), ``fused`` or ``eager``.

    Raises:
        ValueError: an unknown ``kernel``.
    """
    if kernel not in ("auto", "fused", "eager"):
        raise ValueError(f"ring attention kernel {kernel!r} is unknown; use auto, fused or eager")
    fused = kernel == "fused" or (kernel == "auto" and device.type == "cuda")
    return FusedBlocks(cuda=device.type == "cuda") if fused else EagerBlocks()
