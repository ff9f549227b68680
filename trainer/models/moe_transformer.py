"""A mixture-of-experts decoder: `llama.Llama` whose feed-forwards are routed `moe.MoE` layers.

Sources: Jiang et al. 2024, "Mixtral of Experts"; Qwen Team 2025, "Qwen3 Technical Report"
(Qwen3-30B-A3B: 128 experts, top-8, no shared experts); DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report" (the first blocks dense, shared experts, sigmoid routing with an expert bias).

The attention, norms, embeddings and RoPE are the Llama ones (same module names), so everything
that handles a Llama handles this model too; only ``layers.<i>.feed_forward`` differs for the MoE
blocks ``i >= n_dense_layers``: ``feed_forward.router.gate`` ``[E, D]``,
``feed_forward.router.expert_bias`` ``[E]`` (buffer), ``feed_forward.experts.{w1,w3}``
``[E, F, D]``, ``feed_forward.experts.w2`` ``[E, D, F]`` and, with shared experts,
``feed_forward.shared_experts.{w1,w2,w3}``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from typing_extensions import override

from trainer.models.llama import Llama
from trainer.models.mla import LatentAttention, mla_matmul_params, mla_problems, mla_softmax_factor
from trainer.models.moe import MoE
from trainer.models.moe_router import ScoreFunc

SCORE_FUNCS = ("softmax", "sigmoid")


def moe_problems(
    *,
    num_experts: Any,
    top_k: Any,
    moe_ffn_dim: Any,
    n_dense_layers: Any,
    n_layers: Any,
    score_func: Any,
    num_shared_experts: Any = 0,
    n_group: Any = 1,
    topk_group: Any = 1,
) -> list[str]:
    """What is wrong with a mixture-of-experts shape, each message naming the field to change."""
    problems = []
    for name, value, low in [
        ("num_experts", num_experts, 1),
        ("top_k", top_k, 1),
        ("moe_ffn_dim", moe_ffn_dim, 1),
        ("n_dense_layers", n_dense_layers, 0),
        ("num_shared_experts", num_shared_experts, 0),
        ("n_group", n_group, 1),
        ("topk_group", topk_group, 1),
    ]:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"model.{name} must be an int >= {low}, got {value!r}")
    if not problems and top_k > num_experts:
        problems.append(f"model.top_k={top_k} exceeds model.num_experts={num_experts}; valid top_k: 1..{num_experts}")
    if not problems and isinstance(n_layers, int) and n_dense_layers >= n_layers:
        problems.append(f"model.n_dense_layers={n_dense_layers} leaves no MoE block of n_layers={n_layers}")
    if not problems and (num_experts % n_group or topk_group > n_group):
        valid = ", ".join(str(g) for g in range(1, num_experts + 1) if num_experts % g == 0)
        problems.append(
            f"model.n_group={n_group} must divide model.num_experts={num_experts} (valid: {valid}) and be at least "
            f"model.topk_group={topk_group}"
        )
    elif not problems and topk_group * (num_experts // n_group) < top_k:
        problems.append(
            f"model.topk_group={topk_group} groups of {num_experts // n_group} experts hold fewer than "
            f"model.top_k={top_k}; raise model.topk_group to {-(-top_k // (num_experts // n_group))}"
        )
    if score_func not in SCORE_FUNCS:
        problems.append(f"model.score_func={score_func!r} is not one of {', '.join(SCORE_FUNCS)}")
    return problems


class MoETransformer(Llama):
    """A Llama decoder whose blocks from ``n_dense_layers`` on have a routed MoE feed-forward.

    Args:
        num_experts: routed experts per MoE block E.
        top_k: experts per token K (``1 <= K <= E``).
        moe_ffn_dim: hidden size of each expert F.
        n_dense_layers: the first blocks keep a dense SwiGLU of ``ffn_dim`` (DeepSeek-V3: 3).
        num_shared_experts: always-on experts per MoE block (DeepSeek-V3: 1).
        score_func: ``"softmax"`` (Mixtral, Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3).
        norm_topk: renormalise the top-k weights to sum to 1.
        route_scale: factor on the routing weights (DeepSeek-V3: 2.5).
        n_group: expert groups for group-limited routing (DeepSeek-V3: 8; 1: none, see `moe.route`).
        topk_group: groups each token's experts come from (DeepSeek-V3: 4).
        balance_coef: weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4; 0 off).
        z_loss_coef: weight of the router z-loss (ST-MoE: 1e-3; 0 off).
        bias_update_rate: step of the auxiliary-loss-free expert bias, applied once per optimizer
            step by `trainer.callbacks.expert_bias.ExpertBiasUpdate` (DeepSeek-V3: 1e-3; 0 off).
        vocab_size: tokens of the vocabulary (the trainer passes the tokenizer's).
        latent_attention: multi-head latent attention instead of grouped-query attention
            (DeepSeek-V3), ``{q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
            v_head_dim}`` and optionally ``rope_interleave`` (see `trainer.models.mla`); None for GQA.
        biases: biases on each MoE block's router gate and experts (GPT-OSS; `moe.MoE`).
        expert_activation: the experts' gating, ``"silu"`` (SwiGLU) or ``"clamped_swiglu"``
            (GPT-OSS: ``swiglu_alpha`` 1.702, ``swiglu_limit`` 7; `moe.clamped_swiglu`).
        **llama: the `Llama` arguments (attention, widths, ``ffn_dim`` of the dense blocks, ...).

    Raises:
        ValueError: a size is not positive, ``top_k > num_experts``, no block is an MoE block,
            or an unknown ``score_func``; or what `Llama` raises.
    """

    # Every weight is drawn per name and row block (the experts too): built on the meta device and
    # filled shard by shard (DTensor and expert-parallel shards) with the one-process values.
    META_INIT = True

    def __init__(
        self,
        *,
        vocab_size: int,
        num_experts: int,
        top_k: int,
        moe_ffn_dim: int,
        n_dense_layers: int = 0,
        num_shared_experts: int = 0,
        score_func: ScoreFunc = "softmax",
        norm_topk: bool = True,
        route_scale: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        latent_attention: dict[str, Any] | None = None,
        biases: bool = False,
        expert_activation: Literal["silu", "clamped_swiglu"] = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        **llama: Any,
    ) -> None:
        problems = moe_problems(
            num_experts=num_experts,
            top_k=top_k,
            moe_ffn_dim=moe_ffn_dim,
            n_dense_layers=n_dense_layers,
            n_layers=llama.get("n_layers"),
            score_func=score_func,
            num_shared_experts=num_shared_experts,
            n_group=n_group,
            topk_group=topk_group,
        )
        self.latent_attention = dict(latent_attention) if latent_attention else None
        problems += mla_problems(self.latent_attention) if self.latent_attention else []
        if problems:
            raise ValueError("; ".join(problems))
        # Set before Llama.__init__, which builds the blocks through make_feed_forward.
        self.num_experts, self.top_k, self.moe_ffn_dim = num_experts, top_k, moe_ffn_dim
        self.n_dense_layers, self.num_shared_experts = n_dense_layers, num_shared_experts
        self.score_func, self.norm_topk, self.route_scale = score_func, norm_topk, route_scale
        self.n_group, self.topk_group = n_group, topk_group
        self.balance_coef, self.z_loss_coef, self.bias_update_rate = balance_coef, z_loss_coef, bias_update_rate
        self.biases, self.expert_activation = biases, expert_activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        super().__init__(vocab_size=vocab_size, **llama)

    @override
    def make_feed_forward(self, layer: int) -> nn.Module | None:
        if layer < self.n_dense_layers:
            return None
        return MoE(
            self.dim,
            self.moe_ffn_dim,
            self.num_experts,
            self.top_k,
            score_func=self.score_func,
            norm_topk=self.norm_topk,
            route_scale=self.route_scale,
            n_group=self.n_group,
            topk_group=self.topk_group,
            num_shared_experts=self.num_shared_experts,
            balance_coef=self.balance_coef,
            z_loss_coef=self.z_loss_coef,
            bias_update_rate=self.bias_update_rate,
            biases=self.biases,
            expert_activation=self.expert_activation,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )

    @override
    def make_attention(self, layer: int) -> nn.Module | None:
        if self.latent_attention is None:
            return None
        return LatentAttention(
            self.dim,
            self.n_heads,
            **self.latent_attention,
            norm_eps=self.norm_eps,
            softmax_factor=mla_softmax_factor(self.rope_scaling),
        )

    @property
    @override
    def rope_dim(self) -> int:
        return self.latent_attention["qk_rope_head_dim"] if self.latent_attention else self.head_dim

    @override
    def _apply(self, fn, recurse=True):
        # A cast of the whole model (precision=bf16-true) would round the routers' buffers: the
        # selection bias, whose 1e-3 update steps vanish at magnitudes near 1 (transformers keeps
        # DeepSeek-V3's e_score_correction_bias in float32 too), and the token counts (exact in
        # bf16 only up to 256). They keep float32 and only move with the model.
        kept = {
            (moe, name): buffer
            for moe in (self.moe_layers().values() if "layers" in self._modules else ())
            for name, buffer in moe.named_buffers()
            if buffer.dtype == torch.float32
        }
        super()._apply(fn, recurse)
        for (moe, name), before in kept.items():
            owner, _, leaf = name.rpartition(".")
            module = moe.get_submodule(owner)
            after = module._buffers[leaf]
            if after.dtype != torch.float32:
                module._buffers[leaf] = (
                    torch.empty_like(before, device=after.device) if before.is_meta else before.to(after.device)
                )
        return self

    @override
    def forward(
        self,
        input_ids_bt: torch.Tensor,
        *,
        position_ids_bt: torch.Tensor | None = None,
        document_ids_bt: torch.Tensor | None = None,
        token_mask_bt: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """`Llama.forward`, and ``token_mask_bt``: bool ``[B, T]`` (this rank's tokens under context
        parallelism), False on padding, which the routers leave out of their loads and losses
        (`MoE.forward`); None: no padding. The objectives pass it from the batch
        (`strategies.core.model_contract.model_inputs`).

        Raises:
            ValueError: as `Llama.forward`; ``token_mask_bt`` not of shape ``[B, T]``.
        """
        return self._run(
            input_ids_bt,
            position_ids_bt=position_ids_bt,
            document_ids_bt=document_ids_bt,
            return_hidden=return_hidden,
            token_mask_bt=token_mask_bt,
        )

    def moe_layers(self) -> dict[str, MoE]:
        """``{block name: its MoE}`` of the blocks this module holds (a pipeline stage holds some)."""
        return {name: layer.feed_forward for name, layer in self.layers.items() if isinstance(layer.feed_forward, MoE)}

    @override
    @torch.no_grad()
    def init_weights(self) -> None:
        """Llama's init, which covers the router gates, the shared experts and the stacked experts
        (seeded per name and block of experts: an ep rank draws only its experts): ``w1``/``w3`` ~
        N(0, init_std), ``w2`` ~ N(0, init_std / sqrt(2 n_layers)) like every residual output
        projection; the router buffers (expert biases, counts, statistics) set to 0."""
        super().init_weights()
        if self.rope_cos.is_meta:
            return
        for moe in self.moe_layers().values():
            moe.router.expert_bias.zero_()
            moe.router.tokens_per_expert.zero_()
            moe.statistics.zero_()

    @override
    def set_attention_core(self, core: Any) -> None:
        """`Llama.set_attention_core`; each MoE block also keeps the core, whose ``row_group`` (context
        parallelism) its sequence-wise balance loss counts whole rows over (`moe_router.balance_loss_sum`)."""
        super().set_attention_core(core)
        for moe in self.moe_layers().values():
            moe.rows = core

    def set_router_loss_scale(self, scale: float | None) -> None:
        """``1 / tokens of the optimizer step`` (over all micro-batches and ranks): the router
        losses then average over the step's tokens whatever the layout (see `moe.MoE`)."""
        for moe in self.moe_layers().values():
            moe.router_loss_scale = scale

    def pop_sums(self) -> tuple[list[str], torch.Tensor]:
        """Router statistics since the last call, summed over this rank's MoE blocks, then zeroed:
        names and a ``[2, K]`` tensor, row 0 the sums and row 1 their counts (token x block pairs),
        which the Task reduces over ranks and pipeline stages and divides. ``moe/load/<i>``: expert
        i's share of the routed tokens times E / K (1 is balanced); ``moe/balance_loss``,
        ``moe/z_loss``: per token. The same names on every stage (a stage without MoE blocks, or
        nothing counted: evaluation, counts 0, which the Task leaves out), so the stages reduce together."""
        names = [f"moe/load/{i}" for i in range(self.num_experts)] + ["moe/balance_loss", "moe/z_loss"]
        layers = list(self.moe_layers().values())
        if not layers:
            return names, torch.zeros(2, len(names), device=next(self.parameters()).device)
        stats = torch.stack([moe.statistics for moe in layers]).sum(0)
        for moe in layers:
            moe.statistics.zero_()
        loads = stats[: self.num_experts] * (self.num_experts / self.top_k)
        sums = torch.cat([loads, stats[-3:-1]])
        return names, torch.stack([sums, stats[-1].expand_as(sums)])

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the (E - K) / E unchosen share of the routed experts
        (the figure model cards quote as "activated"), counting this module's blocks."""
        inactive = sum(
            p.numel() * (self.num_experts - self.top_k) // self.num_experts
            for moe in self.moe_layers().values()
            for p in moe.experts.parameters()
        )
        return self.num_params() - inactive

    @override
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 * N_active + 12 * n_layers * dim * seq_len``, N_active the
        matmul weights one token uses (attention, K routed and the shared experts, the router gate
        and the LM head; Llama's rule otherwise, see `Llama.flops_per_token`). With latent
        attention the score term is ``6 * n_layers * seq_len * H * (qk dim + v dim)``."""
        dense = super().flops_per_token(seq_len)
        n_moe = self.n_layers - self.n_dense_layers
        dense_mlp = 3 * self.dim * self.ffn_dim
        moe_mlp = 3 * self.dim * self.moe_ffn_dim * (self.top_k + self.num_shared_experts) + self.dim * self.num_experts
        flops = dense + 6 * n_moe * (moe_mlp - dense_mlp)
        if self.latent_attention:
            mla, q, kv = self.latent_attention, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            gqa = self.dim * q + 2 * self.dim * kv + q * self.dim
            qk_v = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] + mla["v_head_dim"]
            flops += 6 * self.n_layers * (mla_matmul_params(self.dim, self.n_heads, mla) - gqa)
            flops += 6 * self.n_layers * seq_len * self.n_heads * qk_v - 12 * self.n_layers * self.dim * seq_len
        return float(flops)

    @override
    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        """Llama's plan for attention, embeddings, norms and dense blocks; each MoE block's
        feed-forward runs whole on every tp rank (its weights replicated over tp): its input is
        gathered to the full sequence and its output, identical on all tp ranks, sliced back to
        this rank's part of the sequence under sequence parallelism. Latent attention runs whole
        on every tp rank the same way (its weights replicated: the key latent and the rotated key
        part serve every head, so a head-sharded MLA would all-reduce their gradients; not built)."""
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        dense_input = plan.pop("layers.*.feed_forward")
        seq = Shard(1) if sequence_parallel else Replicate()
        if self.latent_attention:
            for name in ("wq", "wk", "wv", "wo"):
                plan.pop(f"layers.*.attention.{name}")
            plan["layers.*.attention"] = PrepareModuleInputOutput(
                input_layouts=(seq, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(seq,),
            )
        for name, layer in self.layers.items():
            if isinstance(layer.feed_forward, MoE):
                plan[f"layers.{name}.feed_forward"] = PrepareModuleInputOutput(  # (x_btd, token_mask_bt)
                    input_layouts=(seq, None),
                    desired_input_layouts=(Replicate(), None),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(seq,),
                )
            else:
                plan[f"layers.{name}.feed_forward"] = dense_input
        return plan
