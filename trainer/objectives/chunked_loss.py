"""Cross-entropy over the vocabulary in token chunks, without the full ``[tokens, V]`` logits.

Source: the chunked / fused linear-cross-entropy of long-context trainers (e.g. Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models"; Liger Kernel's fused linear CE,
Hsu et al. 2024): the LM head and the loss run together, one chunk of tokens at a time, and each
chunk's gradients are computed in the forward, while its logits exist. Saved for backward: the
hidden-state gradient ``[N, D]`` and the fp32 head-weight gradient ``[V, D]``, instead of
``[B, T, V]`` fp32 logits (at long context, T x V >> T x D, most of the activation memory outside
the blocks); no GEMM is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and, when a gradient is wanted, both gradients in one pass over the chunks (forward).

    d(sum CE)/d(logits) = softmax - one_hot(label) is known once a chunk's logits are: the chunk's
    shares of the hidden and weight gradients are computed right there, so no logits are kept
    and none are recomputed; the backward only scales them by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden_nd, weight_vd, labels_n, chunk: int, want_grad: bool):  # noqa: ANN001
        total = torch.zeros((), dtype=torch.float32, device=hidden_nd.device)
        grad_hidden = torch.empty_like(hidden_nd) if want_grad else None
        grad_weight = torch.zeros(weight_vd.shape, dtype=torch.float32, device=weight_vd.device) if want_grad else None
        for a in range(0, hidden_nd.shape[0], chunk):
            h, labels = hidden_nd[a : a + chunk], labels_n[a : a + chunk]
            # Under autocast this GEMM (and the two below) runs in bf16 with fp32 accumulation.
            logits = (h @ weight_vd.t()).float()
            total += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
            if want_grad:
                # Rows without a target get 0 (a mask, not a boolean index: no host sync).
                grad_logits = torch.softmax(logits, dim=-1)
                supervised = labels != IGNORE_INDEX
                grad_logits.scatter_add_(1, labels.clamp(min=0)[:, None], -supervised[:, None].float())
                grad_logits *= supervised[:, None]
                grad_hidden[a : a + chunk] = (grad_logits.to(weight_vd.dtype) @ weight_vd).to(h.dtype)
                grad_weight += (grad_logits.t() @ h.float()).float()
        if want_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight_vd.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype),
            (grad_weight * grad_total).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def chunked_token_loss_sum(
    hidden_btd: torch.Tensor, weight_vd: torch.Tensor, labels_bt: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Sum of per-token cross-entropy (nats, fp32, 0-dim) of ``hidden @ weight.T`` over supervised tokens.

    Equals ``token_loss_sum(hidden @ weight.T, labels)`` (up to fp32 summation order), computing
    the logits of at most ``chunk_tokens`` tokens at a time, in the GEMM precision of the
    surrounding autocast (the softmax in fp32); the weight gradient is accumulated in fp32. Tokens labelled -100 add exactly
    0 (none at all gives exactly 0); they are masked, not gathered out, so nothing waits for the
    device to count them.

    Args:
        hidden_btd: final hidden states ``[B, T, D]`` (after the final norm).
        weight_vd: the LM head weight ``[V, D]``.
        labels_bt: pre-shifted targets ``[B, T]`` (int64, -100 = no target).
        chunk_tokens: tokens per chunk (> 0).

    Raises:
        ValueError: ``chunk_tokens`` is not positive.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    # Inside autograd.Function.forward grad mode is off: decide here whether gradients are wanted.
    want_grad = torch.is_grad_enabled() and (hidden_btd.requires_grad or weight_vd.requires_grad)
    return _ChunkedLinearCE.apply(hidden_btd.flatten(0, 1), weight_vd, labels_bt.flatten(), chunk_tokens, want_grad)
