"""Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; kept in DeepSeek-V3).

Keys and values are up-projected from one small latent per token (``kv_lora_rank`` wide, RMS-
normalised), queries optionally from another (``q_lora_rank``); each head's query and key are
``qk_nope_head_dim`` features without position plus ``qk_rope_head_dim`` rotated ones, the rotated
key part shared by all heads. Attention itself is the model's attention core (document-causal by default,
scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``), so packed rows work as in `attention`.

Shape suffixes: B batch, T sequence length, D model dim, H heads, C latent width, R rotated dims,
P un-rotated dims, V value dims.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.models.attention import DOCUMENT_CAUSAL, apply_rope
from trainer.models.norm import RMSNorm

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


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
    problems = [f"model.latent_attention.{k} is unknown; fields: {fields}" for k in mla if k not in MLA_FIELDS]
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
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, kv_lora_rank
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
        k_rope = apply_rope(k_rope_btr[:, :, None, :], cos, sin).expand(-1, -1, self.n_heads, -1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return self.wo(self.core(q, k, v_bthv, mask).reshape(B, T, -1))
