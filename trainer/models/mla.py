"""Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; kept in DeepSeek-V3).

Keys and values are up-projected from one small latent per token (``kv_lora_rank`` wide, RMS-
normalised), queries optionally from another (``q_lora_rank``); each head's query and key are
``qk_nope_head_dim`` features without position plus ``qk_rope_head_dim`` rotated ones, the rotated
key part shared by all heads. Attention itself is the model's attention core (document-causal by default,
scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's ``mscale_all_dim`` temperature
squared when the RoPE is YaRN-scaled: `mla_softmax_factor`), so packed rows work as in `attention`.

``rope_interleave`` (DeepSeek-V3's checkpoints; transformers' ``rope_interleave``, on by default):
the rotated features are laid out in pairs ``(x0, x1), (x2, x3), ...``, each pair one frequency,
instead of plait's halves ``(x0, x_{R/2})``. The rotated q and k parts are de-interleaved (evens,
then odds) before plait's rotation; both get the same order, so their dot products are the pairs'
rotation, as in transformers' ``apply_rotary_pos_emb_interleave``.

Shape suffixes: B batch, T sequence length, D model dim, H heads, C latent width, R rotated dims,
P un-rotated dims, V value dims.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trainer.models.attention import DOCUMENT_CAUSAL, apply_rope
from trainer.models.norm import RMSNorm
from trainer.models.rope import rope_type

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Optional fields of ``latent_attention`` and their value when left out.
MLA_OPTIONAL = {"rope_interleave": False}


def mla_softmax_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The factor on MLA's softmax scale: ``mscale(factor, mscale_all_dim) ** 2`` under a YaRN
    scaling with ``mscale_all_dim`` (DeepSeek's reference code, transformers' ``yarn_apply_mscale``),
    else 1. YaRN's ``attention_factor`` on the rotated dims is in the RoPE tables (`rope.rope_tables`)."""
    scaling = rope_scaling or {}
    if rope_type(scaling) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    mscale = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return mscale * mscale


def mla_matmul_params(dim: int, n_heads: int, mla: dict[str, int]) -> int:
    """Weights of one block's latent-attention matmuls (for FLOP counts)."""
    qk_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    q_rank = mla["q_lora_rank"]
    q = dim * q_rank + q_rank * n_heads * qk_dim if q_rank else dim * n_heads * qk_dim
    kv = dim * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"]) + mla["kv_lora_rank"] * n_heads * (
        mla["qk_nope_head_dim"] + mla["v_head_dim"]
    )
    return q + kv + n_heads * mla["v_head_dim"] * dim


def mla_problems(mla: dict[str, Any]) -> list[str]:
    """What is wrong with a ``latent_attention`` setting, naming the field."""
    fields = ", ".join(MLA_FIELDS)
    fields += ", " + ", ".join(MLA_OPTIONAL)
    problems = [
        f"model.latent_attention.{k} is unknown; fields: {fields}"
        for k in mla
        if k not in MLA_FIELDS and k not in MLA_OPTIONAL
    ]
    if not isinstance(mla.get("rope_interleave", False), bool):
        problems.append(f"model.latent_attention.rope_interleave must be true or false, got {mla['rope_interleave']!r}")
    for field in MLA_FIELDS:
        value, low = mla.get(field), 0 if field == "q_lora_rank" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"model.latent_attention.{field} must be an int >= {low}, got {value!r}")
    if not problems and mla["qk_rope_head_dim"] % 2:
        problems.append(f"model.latent_attention.qk_rope_head_dim={mla['qk_rope_head_dim']} must be even for RoPE")
    return problems


class LatentAttention(nn.Module):
    """MLA with the same call as `attention.Attention`: ``(x [B, T, D], cos, sin, mask) -> [B, T, D]``.

    Modules: ``wq`` (or ``wq_a``, ``q_norm``, ``wq_b`` when ``q_lora_rank > 0``), ``wkv_a``,
    ``kv_norm``, ``wkv_b``, ``wo``; ``cos``/``sin`` are RoPE tables of ``qk_rope_head_dim``.
    ``rope_interleave``: the checkpoint's rotated features in pairs (see the module docstring);
    ``softmax_factor``: a factor on the scores' scale (`mla_softmax_factor`).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_interleave: bool = False,
        norm_eps: float = 1e-6,
        softmax_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, kv_lora_rank
        self.rope_interleave, self.softmax_factor = rope_interleave, softmax_factor
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.core: Any = DOCUMENT_CAUSAL

    def forward(self, x_btd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
        B, T, _ = x_btd.shape
        q_btd = self.wq_b(self.q_norm(self.wq_a(x_btd))) if self.q_lora_rank else self.wq(x_btd)
        q_nope, q_rope = q_btd.view(B, T, self.n_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent_btc, k_rope_btr = self.wkv_a(x_btd).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_bthx = self.wkv_b(self.kv_norm(latent_btc)).view(B, T, self.n_heads, -1)
        k_nope, v_bthv = kv_bthx.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope_btr[:, :, None, :]
        if self.rope_interleave:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        k_rope = apply_rope(k_rope, cos, sin).expand(-1, -1, self.n_heads, -1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.softmax_factor != 1.0:  # the cores scale by 1/sqrt(qk dim): the factor goes on q
            q = q * self.softmax_factor
        k = torch.cat([k_nope, k_rope], dim=-1)
        return self.wo(self.core(q, k, v_bthv, mask).reshape(B, T, -1))


def _deinterleave(x_bthr: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` -> halves ``(x0, x2, ..., x1, x3, ...)``."""
    return torch.cat([x_bthr[..., 0::2], x_bthr[..., 1::2]], dim=-1)
