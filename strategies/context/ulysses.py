"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all turns
each rank's tokens of all heads into all tokens of its head group before attention, and back after.

Used by `strategies.context.attention.ContextParallelAttention` (cp modes "ulysses" and "hybrid").
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``out[j]`` = rank j's ``x[me]`` along dim 0; its own adjoint (equal splits), so backward is the same op."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        grad = grad.contiguous()  # empty_like would copy a non-contiguous grad's strides
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x_bthe: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """``[B, T, H, E]`` (this rank's tokens, all heads) -> ``[B, degree * T, H / degree, E]``
    (the tokens of all ``degree`` ranks in rank order, this rank's head group)."""
    B, T, H, E = x_bthe.shape
    x = x_bthe.reshape(B, T, degree, H // degree, E).permute(2, 0, 1, 3, 4)
    x = _AllToAll.apply(x.contiguous(), group)  # [degree (source rank), B, T, H/degree, E]
    return x.permute(1, 0, 2, 3, 4).reshape(B, degree * T, H // degree, E)


def heads_to_seq(x_bthe: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """The inverse of `seq_to_heads`: ``[B, degree * T, h, E]`` -> ``[B, T, degree * h, E]``."""
    B, TT, h, E = x_bthe.shape
    x = x_bthe.reshape(B, degree, TT // degree, h, E).permute(1, 0, 2, 3, 4)
    x = _AllToAll.apply(x.contiguous(), group)  # [degree (source head group), B, T, h, E]
    return x.permute(1, 2, 0, 3, 4).reshape(B, TT // degree, degree * h, E)
