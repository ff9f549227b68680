"""The Llama block: a pre-norm transformer block of grouped-query attention and a SwiGLU MLP.

Sources: Touvron et al. 2023, "LLaMA" (pre-norm RMSNorm, SwiGLU, no biases); Shazeer 2020, "GLU
Variants Improve Transformer" (SwiGLU, and the 8/3 hidden-size rule); Ainslie et al. 2023, "GQA".
The model around it (embeddings, RoPE tables, masks, head) is `trainer.models.llama.Llama`.

Shape suffixes on variable names: B batch, T sequence length, D model dim, F ffn dim.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies.transforms.lora import linear_slice
from trainer.models.attention import Attention
from trainer.models.norm import RMSNorm


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``, no biases.

    ``keep_channels(idx)`` restricts the next forwards (and their backward) to the hidden channels
    ``idx`` (sparsity-accelerated training, `strategies.transforms.sat`): the omitted channels' rows of w1/w3
    and columns of w2 are neither read nor given a gradient, nor are the matching rows of a LoRA
    adapter's B (w1/w3) and columns of its A (w2). None (the default) is the dense MLP.
    """

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.ffn_dim = ffn_dim
        self.kept_f: torch.Tensor | None = None

    def keep_channels(self, idx_f: torch.Tensor | None) -> None:
        """Hidden channels ``idx_f`` ([F'] int64, sorted) for the following forwards; None: all."""
        self.kept_f = idx_f

    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        if self.kept_f is None:
            return self.w2(F.silu(self.w1(x_btd)) * self.w3(x_btd))
        # Not F.linear on weight slices: a LoRA adapter (a hook on the layer) or a QLoRA base must
        # be sliced alike, or the sliced forward silently skips the adapter (linear_slice).
        idx = self.kept_f
        h_btf = F.silu(linear_slice(self.w1, x_btd, rows=idx)) * linear_slice(self.w3, x_btd, rows=idx)
        return linear_slice(self.w2, h_btf, cols=idx)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        norm_eps: float,
        feed_forward: nn.Module | None = None,
        attention_layer: nn.Module | None = None,
        **attention: Any,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        # Grouped-query attention, unless the model gives another (multi-head latent attention).
        if attention_layer is None:
            attention_layer = Attention(dim, n_heads, n_kv_heads, norm_eps=norm_eps, **attention)
        self.attention = attention_layer
        self.ffn_norm = RMSNorm(dim, norm_eps)
        # A SwiGLU, unless the model gives another [B, T, D] -> [B, T, D] module (a routed MoE).
        self.feed_forward = FeedForward(dim, ffn_dim) if feed_forward is None else feed_forward

    def forward(self, x_btd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
        h_btd = x_btd + self.attention(self.attention_norm(x_btd), cos, sin, mask)
        return h_btd + self.feed_forward(self.ffn_norm(h_btd))


def llama_ffn_dim(dim: int, multiple_of: int = 64) -> int:
    """The Llama hidden size rule: ``int(8 * dim / 3)`` rounded up to ``multiple_of``.

    SwiGLU has three matrices instead of two, so 2/3 of the usual ``4 * dim``
    keeps the parameter count of a plain 4x MLP.
    """
    hidden = int(8 * dim / 3)
    return multiple_of * math.ceil(hidden / multiple_of)
