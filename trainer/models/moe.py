"""A routed mixture-of-experts feed-forward layer: top-k router, dropless dispatch, grouped experts.

Sources: Shazeer et al. 2017, "Outrageously Large Neural Networks" (top-k gating); Fedus et al.
2021, "Switch Transformers" (the auxiliary balance loss f_i * P_i); Zoph et al. 2022, "ST-MoE"
(router z-loss); Jiang et al. 2024, "Mixtral of Experts" (softmax, top-2, renormalised weights);
DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (sigmoid scores, shared experts, the
sequence-wise balance loss, eq. 17-20, and the auxiliary-loss-free expert bias); Wang et al. 2024,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (the bias update rule);
Gale et al. 2022, "MegaBlocks" (dropless routing with grouped matrix multiplies). The autograd
hook that adds the router losses' gradient follows Megatron-LM's ``MoEAuxLossAutoScaler`` idea.

Shape suffixes: B batch, T sequence length, N tokens (B*T), D model dim, E experts, K experts per
token (top-k), F expert hidden dim, M routed token copies (N*K, sorted by expert).

Every token goes to exactly its K experts (no capacity factor, nothing dropped). Tokens are sorted
by expert, each expert's rows run as one group of ``torch._grouped_mm`` (a per-expert loop where
the grouped kernel cannot run), and the K outputs of each token are summed with its routing
weights. ``GroupedExperts.dispatcher`` runs the sorted rows through the experts; expert parallelism
swaps it for one that exchanges rows between the ranks holding the experts, as context parallelism
swaps the attention core.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.block import FeedForward

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


def balance_loss_sum(scores_bte: torch.Tensor, experts_btk: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over tokens: ``sum_b T * L_b`` with
    ``L_b = sum_i f_bi P_bi``, ``f_bi = E / (K T) * (tokens of row b routed to i)`` (no gradient)
    and ``P_bi`` the mean over row b of the scores normalised to sum to 1 per token.

    Per row, so the loss does not depend on how rows are split into micro-batches or ranks. It is
    1 when routing is uniform and grows to E / K when every token of a row picks the same experts.
    """
    B, T, E = scores_bte.shape
    K = experts_btk.shape[-1]
    ones = torch.ones(B, T * K, device=scores_bte.device)
    counts_be = torch.zeros(B, E, device=scores_bte.device).scatter_add_(1, experts_btk.reshape(B, -1), ones)
    f_be = counts_be * (E / (K * T))
    normed_bte = scores_bte / scores_bte.sum(-1, keepdim=True)
    return (f_be[:, None, :] * normed_bte).sum()


def z_loss_sum(logits_ne: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss summed over tokens: ``sum_n logsumexp(logits_n)^2`` (float32)."""
    return torch.logsumexp(logits_ne.float(), dim=-1).square().sum()


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


# ---------------------------------------------------------------------------------------------- experts
def grouped_mm_supported(x_md: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on these operands: on CPU every stride a multiple of 16
    bytes (float32 or bfloat16; float32 not inside a compiled graph); on CUDA bfloat16 on compute
    capability >= 8.0."""
    if x_md.device.type == "cuda":
        return x_md.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_md.device)[0] >= 8
    if x_md.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x_md.dtype == torch.float32 and torch.compiler.is_compiling():
        # torch 2.13's meta kernel of _grouped_mm, which torch.compile traces with, takes bfloat16
        # only ("Expected inputs of BF16 type"); the eager CPU kernel takes float32.
        return False
    elem = x_md.element_size()
    return all((n * elem) % 16 == 0 for w in (x_md, *weights) for n in w.shape[-2:])


def _grouped(x_md: torch.Tensor, w_eoi: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # w holds [out, in] per expert (the nn.Linear layout); the kernel multiplies by [in, out].
    return torch._grouped_mm(x_md, w_eoi.transpose(-2, -1), offs=offsets)


def pad_groups(counts_e: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's rows rounded up to a multiple of ``align``: ``(padded counts [E], the padded
    position of every row [M])``. CUDA's grouped GEMM wants 16-byte aligned group starts along
    the rows, which the weight-gradient GEMM contracts over (torchtitan pads to 8 bf16 rows too)."""
    padded_e = (counts_e + align - 1) // align * align
    shift_e = torch.cumsum(padded_e - counts_e, 0) - (padded_e - counts_e)
    return padded_e, torch.arange(int(counts_e.sum()), device=counts_e.device) + torch.repeat_interleave(
        shift_e, counts_e
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: ``silu(gate) * up``."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert gating: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (OpenAI's gpt-oss reference ``swiglu``, transformers' ``GptOssExperts``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# A gated expert MLP's gating: plain SwiGLU, or GPT-OSS's clamped form (its alpha and limit).
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


def expert_swiglu(
    x_md: torch.Tensor,
    counts_e: torch.Tensor,
    w1_efd: torch.Tensor,
    w2_edf: torch.Tensor,
    w3_efd: torch.Tensor,
    *,
    grouped: bool | None = None,
    align_rows: int | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """SwiGLU of each expert on its rows: ``w2_e(silu(w1_e x) * w3_e x)``.

    Args:
        x_md: routed rows ``[M, D]``, sorted by expert (the first ``counts_e[0]`` rows are expert 0's).
        counts_e: rows per expert ``[E]`` (int), summing to M.
        w1_efd, w3_efd: gate and up projections ``[E, F, D]``; w2_edf: down projection ``[E, D, F]``.
        grouped: one ``torch._grouped_mm`` per projection (True), a loop over experts (False, the
            reference), or whichever runs here (None, see `grouped_mm_supported`).
        align_rows: pad each group to a multiple of this many rows for the grouped kernel (None:
            8 on CUDA, 1 on CPU; see `pad_groups`).
        biases: ``(b1 [E, F], b2 [E, D], b3 [E, F])`` added to each projection's output (GPT-OSS);
            None: none.
        gate: ``(gate [M, F], up [M, F]) -> [M, F]``, `swiglu` or a `clamped_swiglu`.

    Returns:
        ``[M, D]`` in the rows' order.
    """
    if grouped is None:
        grouped = grouped_mm_supported(x_md, w1_efd, w2_edf)
    if grouped:
        align = (8 if x_md.is_cuda else 1) if align_rows is None else align_rows
        if align > 1:
            counts_e, rows_m = pad_groups(counts_e, align)
            x_md = x_md.new_zeros(int(counts_e.sum()), x_md.shape[1]).index_copy(0, rows_m, x_md)
        offsets = torch.cumsum(counts_e, 0).to(torch.int32)
        g_mf, u_mf = _grouped(x_md, w1_efd, offsets), _grouped(x_md, w3_efd, offsets)
        if biases is not None:  # each row takes its expert's biases
            expert_m = torch.repeat_interleave(torch.arange(counts_e.numel(), device=x_md.device), counts_e)
            g_mf, u_mf = g_mf + biases[0][expert_m], u_mf + biases[2][expert_m]
        y_md = _grouped(gate(g_mf, u_mf), w2_edf, offsets)
        if biases is not None:
            y_md = y_md + biases[1][expert_m]
        return y_md[rows_m] if align > 1 else y_md
    outs = []
    b1, b2, b3 = biases if biases is not None else (None, None, None)
    for e, rows in enumerate(torch.split(x_md, counts_e.tolist())):
        g, u = (F.linear(rows, w[e], None if b is None else b[e]) for w, b in ((w1_efd, b1), (w3_efd, b3)))
        outs.append(F.linear(gate(g, u), w2_edf[e], None if b2 is None else b2[e]))
    return torch.cat(outs) if outs else x_md.new_zeros(0, w2_edf.shape[1])


class Dispatcher(Protocol):
    """Runs routed rows through the experts: rows ``[M, D]`` sorted by (global) expert id, ``counts_e``
    ``[E]`` rows per expert -> ``[M, D]`` outputs in the same order. `LocalDispatch` on one rank;
    expert parallelism exchanges the rows with the ranks that hold the experts
    (`strategies.expert.plugin`)."""

    def __call__(self, x_md: torch.Tensor, counts_e: torch.Tensor, experts: "GroupedExperts") -> torch.Tensor: ...


class LocalDispatch:
    """Every expert on this rank."""

    def __call__(self, x_md: torch.Tensor, counts_e: torch.Tensor, experts: "GroupedExperts") -> torch.Tensor:
        return experts.compute(x_md, counts_e)


LOCAL = LocalDispatch()


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked ``[E, out, in]`` tensors ``w1`` (gate), ``w3`` (up), ``w2`` (down).

    ``forward`` hands the sorted rows to ``dispatcher`` (so FSDP's hooks on this module gather the
    weights first); expert parallelism keeps a slice of the experts on each rank (a DTensor
    sharded on dim 0) and swaps in its own dispatcher. ``biases`` adds ``w1_bias``, ``w3_bias``
    ``[E, F]`` and ``w2_bias`` ``[E, D]``; ``activation`` ``"clamped_swiglu"`` gates with
    `clamped_swiglu` (``swiglu_alpha``, ``swiglu_limit``); both GPT-OSS. ``weight_names``: the
    stacked tensors, in the order of ``compute``'s ``weights``.
    """

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        *,
        biases: bool = False,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation={activation!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.weight_names: tuple[str, ...] = ("w1", "w2", "w3")
        if biases:
            self.w1_bias = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.w3_bias = nn.Parameter(torch.zeros(num_experts, ffn_dim))
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, dim))
            self.weight_names += ("w1_bias", "w2_bias", "w3_bias")
        self.gate = swiglu
        if activation == "clamped_swiglu":
            self.gate = functools.partial(clamped_swiglu, alpha=swiglu_alpha, limit=swiglu_limit)
        self.grouped: bool | None = None  # see expert_swiglu
        self.dispatcher: Dispatcher = LOCAL

    def forward(self, x_md: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Rows ``[M, D]`` sorted by expert, ``counts_e`` ``[E]`` rows each -> ``[M, D]``."""
        return self.dispatcher(x_md, counts_e, self)

    def compute(
        self, x_md: torch.Tensor, counts_e: torch.Tensor, weights: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        """The experts on rows sorted by them: this module's local weights, or ``weights`` =
        ``(w1, w2, w3[, w1_bias, w2_bias, w3_bias])`` (``weight_names``) stacked for the groups of
        ``counts_e`` (a dispatcher's mix of experts)."""
        if weights is None:
            weights = tuple(getattr(self, name) for name in self.weight_names)
        w1, w2, w3 = weights[:3]
        biases = weights[3:] or None
        return expert_swiglu(x_md, counts_e, w1, w2, w3, grouped=self.grouped, biases=biases, gate=self.gate)


# ---------------------------------------------------------------------------------------------- dispatch
def sort_by_expert(experts_nk: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``order_m`` (positions in the flattened ``[N*K]`` choices, grouped by expert, stable) and
    the routed-token counts ``[E]`` (int64)."""
    flat_m = experts_nk.reshape(-1)
    return torch.argsort(flat_m, stable=True), torch.bincount(flat_m, minlength=num_experts)


def combine(y_md: torch.Tensor, order_m: torch.Tensor, weights_nk: torch.Tensor) -> torch.Tensor:
    """Rows in expert order ``[M, D]`` -> each token's weighted sum of its K rows ``[N, D]``,
    summed in float32."""
    N, K = weights_nk.shape
    y_nkd = y_md[torch.argsort(order_m)].view(N, K, -1)
    return (y_nkd.float() * weights_nk[..., None].float()).sum(1).to(y_md.dtype)


# ---------------------------------------------------------------------------------------------- the layer
class _RouterAccounting(torch.autograd.Function):
    """Identity on the layer output; in backward, the router losses get gradient ``scale`` and the
    micro-batch's statistics are added to the layer's sums, once per forward, and only by a
    backward that reaches the router's weight: activation checkpointing's recomputed forward never
    runs this backward, and a pipeline schedule's ``autograd.grad`` for gradient shapes (on empty
    inputs, towards its stage inputs only) does not count."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, router_loss: torch.Tensor, stats: torch.Tensor, moe: "MoE"
    ) -> torch.Tensor:
        ctx.stats, ctx.moe, ctx.num_tokens, ctx.counted = stats, moe, out.shape[0], False
        gate = moe.router.gate.weight
        ctx.gate_node = torch.autograd.graph.get_gradient_edge(gate).node if gate.requires_grad else None
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        moe, stats = ctx.moe, ctx.stats
        # Private, as torch.utils.checkpoint uses it: whether this backward will reach the node
        # that accumulates the gate's gradient (not so in an autograd.grad towards other inputs).
        reaches_gate = ctx.gate_node is None or torch._C._will_engine_execute_node(ctx.gate_node)
        if not ctx.counted and reaches_gate:
            moe.add_statistics(stats)
            ctx.counted = True
        scale = moe.router_loss_scale
        if scale is None:
            scale = 1.0 / max(ctx.num_tokens, 1)
        return grad_out, torch.full((), scale, device=grad_out.device), None, None


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts, replacing a block's feed-forward.

    Args:
        dim: model width D.
        moe_ffn_dim: each expert's hidden size F.
        num_experts: routed experts E.
        top_k: experts per token K.
        score_func, norm_topk, route_scale, n_group, topk_group: see `route`.
        num_shared_experts: experts every token uses (DeepSeek-V3): one SwiGLU of hidden size
            ``num_shared_experts * moe_ffn_dim``, added unweighted; 0 for none.
        balance_coef: weight of the sequence-wise balance loss (`balance_loss_sum`).
        z_loss_coef: weight of the router z-loss (`z_loss_sum`).
        bias_update_rate: step of the auxiliary-loss-free bias (0: the bias stays as loaded, zero
            for a fresh model: plain top-k).
        biases: biases on the router gate and on each expert's three projections (GPT-OSS).
        expert_activation, swiglu_alpha, swiglu_limit: the experts' gating (`GroupedExperts`).

    The router losses are averaged over tokens: each layer adds ``coef * sum / num_tokens`` to the
    objective, where ``num_tokens`` is the optimizer step's tokens over all micro-batches and ranks
    (``router_loss_scale = 1 / num_tokens``, set by the model's owner before the step; unset, the
    micro-batch's own tokens). Their gradient enters in backward; the logged loss excludes them.
    """

    def __init__(
        self,
        dim: int,
        moe_ffn_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        norm_topk: bool = True,
        route_scale: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        num_shared_experts: int = 0,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        biases: bool = False,
        expert_activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            norm_topk=norm_topk,
            route_scale=route_scale,
            n_group=n_group,
            topk_group=topk_group,
        )
        if biases:  # GPT-OSS's gate has a bias (its logits' top-k softmax is norm_topk's renormalised softmax)
            self.router.gate = nn.Linear(dim, num_experts, bias=True)
        self.experts = GroupedExperts(
            dim,
            moe_ffn_dim,
            num_experts,
            biases=biases,
            activation=expert_activation,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
        )
        self.shared_experts = FeedForward(dim, num_shared_experts * moe_ffn_dim) if num_shared_experts else None
        self.balance_coef, self.z_loss_coef, self.bias_update_rate = balance_coef, z_loss_coef, bias_update_rate
        self.router_loss_scale: float | None = None
        # [E loads, balance-loss sum, z-loss sum, tokens] since the last pop_statistics (backward-counted).
        self.register_buffer("statistics", torch.zeros(num_experts + 3), persistent=False)

    def forward(self, x_btd: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``."""
        B, T, D = x_btd.shape
        x_nd = x_btd.reshape(-1, D)
        routing = self.router(x_nd)
        order_m, counts_e = sort_by_expert(routing.experts_nk, self.router.num_experts)
        y_md = self.experts(x_nd[order_m // self.router.top_k], counts_e)
        out_nd = combine(y_md, order_m, routing.weights_nk)
        if self.shared_experts is not None:
            out_nd = out_nd + self.shared_experts(x_nd)
        if torch.is_grad_enabled() and out_nd.requires_grad:
            out_nd = self._account(out_nd, routing, B, T)
        return out_nd.view(B, T, D)

    def _account(self, out_nd: torch.Tensor, routing: Routing, B: int, T: int) -> torch.Tensor:
        E = self.router.num_experts
        # The losses' graph only when they are trained; their values are logged either way.
        with torch.set_grad_enabled(self.balance_coef > 0 or self.z_loss_coef > 0):
            balance = balance_loss_sum(routing.scores_ne.view(B, T, E), routing.experts_nk.view(B, T, -1))
            z_loss = z_loss_sum(routing.logits_ne)
            router_loss = self.balance_coef * balance + self.z_loss_coef * z_loss
        counts = torch.bincount(routing.experts_nk.reshape(-1), minlength=E).float()
        tokens = counts.new_tensor(float(B * T))
        stats = torch.cat([counts, torch.stack([balance.detach(), z_loss.detach(), tokens])])
        return _RouterAccounting.apply(out_nd, router_loss, stats, self)

    @torch.no_grad()
    def add_statistics(self, stats: torch.Tensor) -> None:
        """Adds one micro-batch's ``[E loads, balance sum, z sum, tokens]`` (called in backward)."""
        self.statistics.add_(stats.to(self.statistics))
        self.router.tokens_per_expert.add_(stats[:-3].to(self.router.tokens_per_expert))
