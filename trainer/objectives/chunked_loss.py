"""Cross-entropy over the vocabulary in token chunks, without the full ``[tokens, V]`` logits.

Source: the chunked / fused linear-cross-entropy of long-context trainers (e.g. Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models"; Liger Kernel's fused linear CE):
the LM head and the loss run together, one chunk of tokens at a time, and the backward recomputes
each chunk's logits from the saved hidden states. Saved for backward: the supervised tokens'
hidden states ``[N, D]`` and the head weight, instead of ``[B, T, V]`` fp32 logits; at long
context (T x V >> T x D) this is most of the activation memory outside the blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nd, weight_vd, labels_n, chunk: int):  # noqa: ANN001
        total = torch.zeros((), dtype=torch.float32, device=hidden_nd.device)
        for a in range(0, hidden_nd.shape[0], chunk):
            logits = (hidden_nd[a : a + chunk] @ weight_vd.t()).float()
            total += F.cross_entropy(logits, labels_n[a : a + chunk], reduction="sum")
        ctx.save_for_backward(hidden_nd, weight_vd, labels_n)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001
        hidden_nd, weight_vd, labels_n = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden_nd)
        grad_weight = torch.zeros(weight_vd.shape, dtype=torch.float32, device=weight_vd.device)
        for a in range(0, hidden_nd.shape[0], ctx.chunk):
            h = hidden_nd[a : a + ctx.chunk]
            # d(sum CE)/d(logits) = softmax - one_hot(label), scaled by the incoming gradient.
            grad_logits = torch.softmax((h @ weight_vd.t()).float(), dim=-1)
            grad_logits[torch.arange(h.shape[0], device=h.device), labels_n[a : a + ctx.chunk]] -= 1.0
            grad_logits *= grad_total
            grad_hidden[a : a + ctx.chunk] = (grad_logits.to(weight_vd.dtype) @ weight_vd).to(h.dtype)
            grad_weight += grad_logits.t() @ h.float()
        return grad_hidden, grad_weight.to(weight_vd.dtype), None, None


def chunked_token_loss_sum(
    hidden_btd: torch.Tensor, weight_vd: torch.Tensor, labels_bt: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Sum of per-token cross-entropy (nats, fp32, 0-dim) of ``hidden @ weight.T`` over supervised tokens.

    Equals ``token_loss_sum(hidden @ weight.T, labels)`` (up to fp32 summation order), computing
    the logits of at most ``chunk_tokens`` tokens at a time, forward and backward. Only positions
    with a label other than -100 are projected; none gives exactly 0.

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
    supervised = labels_bt.flatten() != IGNORE_INDEX
    hidden_nd = hidden_btd.flatten(0, 1)[supervised]
    return _ChunkedLinearCE.apply(hidden_nd, weight_vd, labels_bt.flatten()[supervised], chunk_tokens)
