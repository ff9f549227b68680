"""The router of a mixture-of-experts layer (`trainer.models.moe.MoE`): top-k expert choice with
softmax or sigmoid scores, optionally within the best expert groups, its auxiliary losses, and the
auxiliary-loss-free expert bias.

Sources: Shazeer et al. 2017 (top-k gating); Fedus et al. 2021, "Switch Transformers" (the balance
loss f_i * P_i); Zoph et al. 2022, "ST-MoE" (router z-loss); Jiang et al. 2024, "Mixtral of Experts"
(softmax, top-2, renormalised weights); DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (sigmoid
scores, group-limited routing, the sequence-wise balance loss, eq. 17-20, the expert bias); Wang et
al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (the bias update).

Shape suffixes: N tokens, D model dim, E experts, K experts per token (top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

ScoreFunc = Literal["softmax", "sigmoid"]


# ---------------------------------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """One forward's routing decision for N tokens.

    ``experts_nk`` the chosen expert ids (int64, in top-k order); ``weights_nk`` their combine
    weights (float32); ``scores_ne`` the affinities of every expert (float32, softmax or sigmoid
    of ``logits_ne``), which the balance loss uses; ``logits_ne`` the router logits (z-loss).
    """

    experts_nk: torch.Tensor
    weights_nk: torch.Tensor
    scores_ne: torch.Tensor
    logits_ne: torch.Tensor


def route(
    logits_ne: torch.Tensor,
    *,
    top_k: int,
    score_func: ScoreFunc = "softmax",
    expert_bias_e: torch.Tensor | None = None,
    norm_topk: bool = True,
    route_scale: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> Routing:
    """Top-k routing of N tokens over E experts.

    Scores are ``softmax`` or ``sigmoid`` of the logits, in float32. The K experts with the
    highest ``scores + expert_bias`` are chosen; the bias (DeepSeek-V3's auxiliary-loss-free
    balancing) only steers the choice: the weights are the chosen experts' unbiased scores,
    divided by their sum when ``norm_topk``, then multiplied by ``route_scale``. With
    ``n_group > 1`` the choice is group-limited (DeepSeek-V3's node-limited routing): the E experts
    form ``n_group`` consecutive groups, each scored by the sum of its two highest biased scores,
    and the K experts are chosen within the ``topk_group`` best groups only.

    Args:
        logits_ne: router logits ``[N, E]``.
        top_k: experts per token K, ``1 <= K <= E``.
        score_func: ``"softmax"`` (Mixtral, Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3).
        expert_bias_e: selection bias ``[E]`` or None.
        norm_topk: renormalise the K weights to sum to 1.
        route_scale: factor on the weights (DeepSeek-V3's ``routed_scaling_factor``).
        n_group: expert groups G (dividing E); 1: no group limit.
        topk_group: groups a token's experts come from (``1 <= topk_group <= G``, with
            ``topk_group * E / G >= K``).
    """
    scores_ne = logits_ne.float().softmax(-1) if score_func == "softmax" else logits_ne.float().sigmoid()
    select_ne = scores_ne if expert_bias_e is None else scores_ne + expert_bias_e.float()
    if n_group > 1:
        select_ne = limit_to_groups(select_ne, n_group, topk_group)
    experts_nk = select_ne.topk(top_k, dim=-1).indices
    weights_nk = scores_ne.gather(-1, experts_nk)
    if norm_topk:
        weights_nk = weights_nk / (weights_nk.sum(-1, keepdim=True) + 1e-20)
    return Routing(experts_nk, weights_nk * route_scale, scores_ne, logits_ne)


def limit_to_groups(select_ne: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``select_ne`` with the experts outside each token's ``topk_group`` best groups set to -inf;
    a group's score is the sum of its two highest values (transformers' ``DeepseekV3TopkRouter``,
    DeepSeek-V3's ``noaux_tc``; one expert per group: that expert's value)."""
    N, E = select_ne.shape
    select_ngx = select_ne.view(N, n_group, E // n_group)
    group_ng = select_ngx.topk(min(2, E // n_group), dim=-1).values.sum(-1)
    keep_ng = torch.zeros_like(group_ng, dtype=torch.bool).scatter_(1, group_ng.topk(topk_group, dim=-1).indices, True)
    return select_ngx.masked_fill(~keep_ng[..., None], float("-inf")).view(N, E)


def balance_loss_sum(
    scores_bte: torch.Tensor,
    experts_btk: torch.Tensor,
    row_group: dist.ProcessGroup | None = None,
    token_mask_bt: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over tokens: ``sum_b T_b * L_b`` with
    ``L_b = sum_i f_bi P_bi``, ``f_bi = E / (K T_b) * (tokens of row b routed to i)`` (no gradient)
    and ``P_bi`` the mean over row b of the scores normalised to sum to 1 per token. ``T_b``: the
    row's real tokens, those ``token_mask_bt`` (bool ``[B, T]``) holds True (None: all ``T``);
    padding counts in neither ``f`` nor ``P`` (as transformers' ``load_balancing_loss_func`` leaves
    out what its attention mask leaves out), and a row of padding alone adds 0.

    Per row, so the loss does not depend on how rows are split into micro-batches or ranks. It is
    1 when routing is uniform and grows to E / K when every token of a row picks the same experts.

    ``row_group``: the ranks that hold the other tokens of these rows (context parallelism: each
    holds ``T`` of the row's ``T x size`` tokens), None for whole rows. ``f`` then counts the whole
    rows (its counts summed over the group, as Megatron's sequence-wise auxiliary loss does over its
    tp x cp group) and each rank returns its tokens' share of the sum, so the group's shares add up to
    the whole rows' loss sum and its gradient.
    """
    B, T, E = scores_bte.shape
    K = experts_btk.shape[-1]
    real_bt = torch.ones(B, T, device=scores_bte.device) if token_mask_bt is None else token_mask_bt.float()
    ones = real_bt[:, :, None].expand(B, T, K).reshape(B, -1)
    counts_be = torch.zeros(B, E, device=scores_bte.device).scatter_add_(1, experts_btk.reshape(B, -1), ones)
    # [B, E + 1]: the counts and the row's real tokens, reduced together over the row's ranks.
    counts_be1 = torch.cat([counts_be, real_bt.sum(1, keepdim=True)], 1)
    if row_group is not None:
        counts_be1 = funcol.all_reduce(counts_be1, "sum", row_group)
    counts_be, row_len_b1 = counts_be1[:, :E], counts_be1[:, E:].clamp(min=1.0)
    f_be = counts_be * (E / (K * row_len_b1))
    normed_bte = scores_bte / scores_bte.sum(-1, keepdim=True)
    return (f_be[:, None, :] * normed_bte * real_bt[:, :, None]).sum()


def z_loss_sum(logits_ne: torch.Tensor, token_mask_n: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss summed over tokens: ``sum_n logsumexp(logits_n)^2`` (float32), over
    the tokens ``token_mask_n`` (bool ``[N]``) holds True when given."""
    z_n = torch.logsumexp(logits_ne.float(), dim=-1).square()
    return z_n.sum() if token_mask_n is None else (z_n * token_mask_n).sum()


class TopKRouter(nn.Module):
    """The gate ``[D] -> [E]`` and the top-k choice (see `route`).

    ``expert_bias`` (persistent buffer ``[E]``, zeros) is DeepSeek-V3's auxiliary-loss-free
    selection bias, moved by ``update_expert_bias`` once per optimizer step from the step's
    ``tokens_per_expert`` (non-persistent buffer, counted in backward so activation
    checkpointing's recomputation does not count twice and evaluation does not count at all).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc,
        norm_topk: bool,
        route_scale: float,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk, self.route_scale = score_func, norm_topk, route_scale
        self.n_group, self.topk_group = n_group, topk_group
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x_nd: torch.Tensor) -> Routing:
        """``[N, D]`` tokens -> their `Routing`. The expert bias always steers the choice: zero
        (never updated) it changes nothing; a checkpoint's (DeepSeek-V3) routes as it was trained."""
        return route(
            self.gate(x_nd),
            top_k=self.top_k,
            score_func=self.score_func,
            expert_bias_e=self.expert_bias,
            norm_topk=self.norm_topk,
            route_scale=self.route_scale,
            n_group=self.n_group,
            topk_group=self.topk_group,
        )

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_e: torch.Tensor, rate: float) -> None:
        """``bias_i += rate * sign(mean load - load_i)`` (Wang et al. 2024, Algorithm 1); the
        counts are the whole step's over every rank that routes tokens."""
        load = tokens_per_expert_e.to(self.expert_bias)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))
