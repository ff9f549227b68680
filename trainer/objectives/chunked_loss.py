"""Cross-entropy over the vocabulary in token chunks, without the full ``[tokens, V]`` logits.

Source: the chunked / fused linear-cross-entropy of long-context trainers (e.g. Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models"; Liger Kernel's fused linear CE):
the LM head and the loss run together, one chunk of tokens at a time, and the backward recomputes
each chunk's logits from the saved hidden states. Saved for backward: the hidden states ``[N, D]``
and the head weight, instead of ``[B, T, V]`` fp32 logits; at long
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
            total += F.cross_entropy(logits, labels_n[a : a + chunk], reduction="sum", ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(hidden_nd, weight_vd, labels_n)
        # The backward runs outside autocast: it redoes the forward's GEMM precision (bf16 GEMMs
        # with fp32 accumulation under bf16 autocast) instead of falling back to fp32 GEMMs.
        device = hidden_nd.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001
        hidden_nd, weight_vd, labels_n = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        grad_hidden = torch.empty_like(hidden_nd)
        grad_weight = torch.zeros(weight_vd.shape, dtype=torch.float32, device=weight_vd.device)
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for a in range(0, hidden_nd.shape[0], ctx.chunk):
                h, labels = hidden_nd[a : a + ctx.chunk], labels_n[a : a + ctx.chunk]
                # d(sum CE)/d(logits) = softmax - one_hot(label), scaled by the incoming gradient;
                # rows without a target get 0 (a mask, not a boolean index: no host sync).
                grad_logits = torch.softmax((h @ weight_vd.t()).float(), dim=-1)
                supervised = labels != IGNORE_INDEX
                grad_logits.scatter_add_(1, labels.clamp(min=0)[:, None], -supervised[:, None].float())
                grad_logits *= supervised[:, None] * grad_total
                grad_hidden[a : a + ctx.chunk] = (grad_logits.to(weight_vd.dtype) @ weight_vd).to(h.dtype)
                grad_weight += (grad_logits.t() @ h.float()).float()
        return grad_hidden, grad_weight.to(weight_vd.dtype), None, None


def chunked_token_loss_sum(
    hidden_btd: torch.Tensor, weight_vd: torch.Tensor, labels_bt: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Sum of per-token cross-entropy (nats, fp32, 0-dim) of ``hidden @ weight.T`` over supervised tokens.

    Equals ``token_loss_sum(hidden @ weight.T, labels)`` (up to fp32 summation order), computing
    the logits of at most ``chunk_tokens`` tokens at a time, forward and backward, in the GEMM
    precision of the surrounding autocast (the softmax in fp32). Tokens labelled -100 add exactly
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
    return _ChunkedLinearCE.apply(hidden_btd.flatten(0, 1), weight_vd, labels_bt.flatten(), chunk_tokens)
