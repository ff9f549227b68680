"""A routed mixture-of-experts feed-forward layer: top-k router (`trainer.models.moe_router`), dropless
dispatch, grouped experts.

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
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.block import FeedForward
from trainer.models.moe_router import Routing, ScoreFunc, TopKRouter, balance_loss_sum, z_loss_sum


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
        ctx.stats, ctx.moe, ctx.counted = stats, moe, False
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
        if scale is None:  # the micro-batch's own real tokens (the last statistic)
            return grad_out, 1.0 / stats[-1].clamp(min=1.0).to(grad_out.device), None, None
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
        # The model's attention core (`MoETransformer.set_attention_core`): its ``row_group`` holds the
        # other tokens of the rows under context parallelism (the sequence-wise balance loss counts whole rows).
        self.rows: Any = None
        # [E loads, balance-loss sum, z-loss sum, tokens] since the last pop_statistics (backward-counted).
        self.register_buffer("statistics", torch.zeros(num_experts + 3), persistent=False)

    def forward(self, x_btd: torch.Tensor, token_mask_bt: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``. ``token_mask_bt``: bool ``[B, T]``, False on padding (None: no
        padding). Every token runs through its experts (dropless), but padding is left out of the
        router's statistics (expert loads, hence the expert-bias update) and of its losses."""
        B, T, D = x_btd.shape
        x_nd = x_btd.reshape(-1, D)
        routing = self.router(x_nd)
        order_m, counts_e = sort_by_expert(routing.experts_nk, self.router.num_experts)
        y_md = self.experts(x_nd[order_m // self.router.top_k], counts_e)
        out_nd = combine(y_md, order_m, routing.weights_nk)
        if self.shared_experts is not None:
            out_nd = out_nd + self.shared_experts(x_nd)
        if torch.is_grad_enabled() and out_nd.requires_grad:
            out_nd = self._account(out_nd, routing, B, T, token_mask_bt)
        return out_nd.view(B, T, D)

    def _account(
        self, out_nd: torch.Tensor, routing: Routing, B: int, T: int, token_mask_bt: torch.Tensor | None
    ) -> torch.Tensor:
        E = self.router.num_experts
        real_n = None if token_mask_bt is None else token_mask_bt.reshape(-1)
        # The losses' graph only when they are trained; their values are logged either way.
        with torch.set_grad_enabled(self.balance_coef > 0 or self.z_loss_coef > 0):
            row_group = getattr(self.rows, "row_group", None)
            balance = balance_loss_sum(
                routing.scores_ne.view(B, T, E), routing.experts_nk.view(B, T, -1), row_group, token_mask_bt
            )
            z_loss = z_loss_sum(routing.logits_ne, real_n)
            router_loss = self.balance_coef * balance + self.z_loss_coef * z_loss
        experts_nk = routing.experts_nk
        if real_n is None:
            counts = torch.bincount(experts_nk.reshape(-1), minlength=E).float()
            tokens = counts.new_tensor(float(B * T))
        else:
            weights = real_n[:, None].expand_as(experts_nk).reshape(-1).float()
            counts = torch.bincount(experts_nk.reshape(-1), weights, minlength=E).float()
            tokens = real_n.sum().float()
        stats = torch.cat([counts, torch.stack([balance.detach(), z_loss.detach(), tokens])])
        return _RouterAccounting.apply(out_nd, router_loss, stats, self)

    @torch.no_grad()
    def add_statistics(self, stats: torch.Tensor) -> None:
        """Adds one micro-batch's ``[E loads, balance sum, z sum, tokens]`` (called in backward)."""
        self.statistics.add_(stats.to(self.statistics))
        self.router.tokens_per_expert.add_(stats[:-3].to(self.router.tokens_per_expert))
