"""The Llama block: a transformer block of grouped-query attention and a gated MLP, its norms
before each sublayer (pre-norm), on each sublayer's output (post-norm, OLMo 2) or both (sandwich,
Gemma 3).

Sources: Touvron et al. 2023, "LLaMA" (pre-norm RMSNorm, SwiGLU, no biases); Shazeer 2020, "GLU
Variants Improve Transformer" (SwiGLU, and the 8/3 hidden-size rule); Ainslie et al. 2023, "GQA";
Team OLMo 2024, "2 OLMo 2 Furious" (the norm on each sublayer's output, inside the residual);
Gemma Team 2025, "Gemma 3 Technical Report" (pre- and post-norms, GeGLU with tanh-approximated GELU).
The model around it (embeddings, RoPE tables, masks, head) is `trainer.models.llama.Llama`.

Shape suffixes on variable names: B batch, T sequence length, D model dim, F ffn dim.
"""

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies.transforms.lora import linear_slice
from trainer.models.attention import Attention
from trainer.models.norm import RMSNorm

# A gated MLP's activation: SwiGLU (Llama) or GeGLU with the tanh GELU (Gemma).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1(x)) * w3(x))``, no biases; ``act`` SiLU (SwiGLU) or tanh-GELU (GeGLU).

    ``keep_channels(idx)`` restricts the next forwards (and their backward) to the hidden channels
    ``idx`` (sparsity-accelerated training, `strategies.transforms.sat`): the omitted channels' rows of w1/w3
    and columns of w2 are neither read nor given a gradient, nor are the matching rows of a LoRA
    adapter's B (w1/w3) and columns of its A (w2). None (the default) is the dense MLP.
    """

    def __init__(self, dim: int, ffn_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
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
            return self.w2(self.act(self.w1(x_btd)) * self.w3(x_btd))
        # Not F.linear on weight slices: a LoRA adapter (a hook on the layer) or a QLoRA base must
        # be sliced alike, or the sliced forward silently skips the adapter (linear_slice).
        idx = self.kept_f
        h_btf = self.act(linear_slice(self.w1, x_btd, rows=idx)) * linear_slice(self.w3, x_btd, rows=idx)
        return linear_slice(self.w2, h_btf, cols=idx)


# Where a block's norms sit: before each sublayer (Llama), on each sublayer's output (OLMo 2), or
# both (Gemma 3's sandwich).
NORM_PLACEMENTS = ("pre", "post", "sandwich")


class TransformerBlock(nn.Module):
    """A residual block of attention and feed-forward, its RMSNorms placed by ``norm_placement``.

    ``"pre"``: ``h = x + attn(attention_norm(x)); out = h + ffn(ffn_norm(h))``.
    ``"post"``: ``h = x + post_attention_norm(attn(x)); out = h + post_ffn_norm(ffn(h))``; the
    residual stream itself is never normalised (only the final norm before the head sees it).
    ``"sandwich"``: all four. The norms a placement does not use are None. ``norm_unit_offset``:
    Gemma's ``1 + weight`` norms (`RMSNorm`); ``activation``: the MLP's (`ACTIVATIONS`).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_dim: int,
        norm_eps: float,
        feed_forward: nn.Module | None = None,
        attention_layer: nn.Module | None = None,
        norm_placement: str = "pre",
        norm_unit_offset: bool = False,
        activation: str = "silu",
        **attention: Any,
    ) -> None:
        super().__init__()
        if norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={norm_placement!r} is not one of {', '.join(NORM_PLACEMENTS)}")
        pre, post = norm_placement in ("pre", "sandwich"), norm_placement in ("post", "sandwich")
        norm = functools.partial(RMSNorm, dim, norm_eps, unit_offset=norm_unit_offset)
        self.attention_norm = norm() if pre else None
        # Grouped-query attention, unless the model gives another (multi-head latent attention).
        if attention_layer is None:
            attention_layer = Attention(
                dim, n_heads, n_kv_heads, norm_eps=norm_eps, norm_unit_offset=norm_unit_offset, **attention
            )
        self.attention = attention_layer
        self.post_attention_norm = norm() if post else None
        self.ffn_norm = norm() if pre else None
        # A gated MLP, unless the model gives another [B, T, D] -> [B, T, D] module (a routed MoE);
        # one whose forward declares token_mask_bt gets it: ffn(x_btd, token_mask_bt) (`trainer.models.moe.MoE`).
        self.feed_forward = FeedForward(dim, ffn_dim, activation) if feed_forward is None else feed_forward
        self.routes_tokens = "token_mask_bt" in inspect.signature(self.feed_forward.forward).parameters
        self.post_ffn_norm = norm() if post else None

    def forward(
        self, x_btd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, **routed: torch.Tensor | None
    ) -> torch.Tensor:
        """``routed``: ``token_mask_bt`` for a routed feed-forward (`routes_tokens`), nothing for the dense one."""
        h_btd = x_btd + _norm(
            self.post_attention_norm, self.attention(_norm(self.attention_norm, x_btd), cos, sin, mask)
        )
        ffn_in = _norm(self.ffn_norm, h_btd)
        ffn_out = self.feed_forward(ffn_in, routed["token_mask_bt"]) if routed else self.feed_forward(ffn_in)
        return h_btd + _norm(self.post_ffn_norm, ffn_out)


def _norm(norm: nn.Module | None, x_btd: torch.Tensor) -> torch.Tensor:
    return x_btd if norm is None else norm(x_btd)


def llama_ffn_dim(dim: int, multiple_of: int = 64) -> int:
    """The Llama hidden size rule: ``int(8 * dim / 3)`` rounded up to ``multiple_of``.

    SwiGLU has three matrices instead of two, so 2/3 of the usual ``4 * dim``
    keeps the parameter count of a plain 4x MLP.
    """
    hidden = int(8 * dim / 3)
    return multiple_of * math.ceil(hidden / multiple_of)
