"""The model's shape: its sizes and parameter tensors, read from a model built on the meta device.

`ModelShape` is what validation, every plugin's ``problems`` and the planner know about the model
(a 405B model on the meta device costs nothing). Each parameter carries the dimension tensor
parallelism shards, taken from the model's own ``tp_plan``.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from strategies.core.model_contract import SIZES, declares, member_problem, missing, optional


class ModelContractError(ValueError):
    """A model lacks a member of its declared contract (`strategies.core.model_contract`); the message names it."""


class ShardsOwnParams:
    """A tensor-parallel style that also shards parameters of its module's own (not of a Linear
    child): ``param_tp_dims`` maps each one's name to the dim it splits (GPT-OSS's attention sinks,
    by head: `trainer.models.llama_tp.PrepareSinkAttention`)."""

    param_tp_dims: dict[str, int] = {}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name, full shape and the dim tp shards (None: replicated).

    ``grad_tp_replicated``: its gradient is a full (Replicate) DTensor on every tp rank although the
    parameter is sharded; torch 2.13 does this for a row-wise (vocabulary-sharded) embedding.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    layer: int | None  # block index; None for the embedding, final norm and output head
    grad_tp_replicated: bool = False


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-style decoder and its parameter tensors.

    Build with `from_model` (a model on the meta device is enough). A mixture of experts
    (`trainer.models.moe_transformer`) also has ``num_experts`` routed experts of hidden size
    ``moe_ffn_dim`` per MoE block, ``top_k`` of them per token, plus ``num_shared_experts``
    always-on ones; blocks below ``n_dense_layers`` are dense (0, 0, None, 0, 0 for a dense model).
    The blocks of ``window_layers`` attend within ``sliding_window`` tokens (Gemma 3).
    ``latent_attention``: multi-head latent attention's ranks and head widths (DeepSeek-V3, the
    model's ``latent_attention``: `trainer.models.mla`), None for grouped-query attention.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool
    params: tuple[ParamSpec, ...]
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int | None = None
    num_shared_experts: int = 0
    n_dense_layers: int = 0
    linear_modules: tuple[str, ...] = ()  # FQNs of the nn.Linear layers (what LoRA's patterns select)
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # every block's attention has sinks, written out (GPT-OSS)
    expert_activation: str = "silu"  # the experts' gating; "clamped_swiglu": GPT-OSS's, with biases
    latent_attention: Mapping[str, Any] | None = None
    head_size: int | None = None  # the model's own head width (``head_dim``); None: dim / n_heads

    @property
    def head_dim(self) -> int:
        """Features per attention head: the model's ``head_dim`` (Qwen3, GPT-OSS: not dim / n_heads)."""
        return self.head_size or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The features RoPE rotates per head: latent attention's ``qk_rope_head_dim``, else the head."""
        return self.latent_attention["qk_rope_head_dim"] if self.latent_attention else self.head_dim

    @property
    def attention_width(self) -> int:
        """Half of the per-token widths the scores and the weighted values span, summed over the heads:
        ``H * E`` for grouped-query attention (``dim`` unless the model sets its own head width), ``H * (qk + v) / 2`` for latent attention
        (its keys are qk_nope + qk_rope wide, its values v_head_dim)."""
        mla = self.latent_attention
        if not mla:
            return self.n_heads * self.head_dim
        return self.n_heads * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] + mla["v_head_dim"]) // 2

    def attention_params(self) -> int:
        """Weights one token meets in a block's attention projections (q, k, v, o; or latent
        attention's down and up projections, `trainer.models.mla`)."""
        mla = self.latent_attention
        if not mla:
            q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return self.dim * (2 * q + 2 * kv)
        qk, d, h = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], self.dim, self.n_heads
        rank = mla["q_lora_rank"]
        q = d * rank + rank * h * qk if rank else d * h * qk
        kv = d * (mla["kv_lora_rank"] + mla["qk_rope_head_dim"])
        kv += mla["kv_lora_rank"] * h * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
        return q + kv + h * mla["v_head_dim"] * d

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @functools.cached_property
    def params_of_layer(self) -> Mapping[int | None, tuple[ParamSpec, ...]]:
        """Each block's parameter tensors in ``params`` order (None: the embedding, final norm and
        head), grouped once per shape: the planner reads them per block for every layout it tries."""
        groups: dict[int | None, list[ParamSpec]] = {}
        for spec in self.params:
            groups.setdefault(spec.layer, []).append(spec)
        return {layer: tuple(specs) for layer, specs in groups.items()}

    @functools.cached_property
    def block_kinds(self) -> tuple[Mapping[int, int], tuple[tuple[ParamSpec, ...], ...]]:
        """``(kind of each block, the parameter tensors of one block of each kind)``, grouped once per
        shape, so that what the planner sums over a rank's tensors for every layout it tries costs
        one term per kind. Blocks are alike when their tensors have the same names past
        ``layers.<i>.``, shapes, tp dims and gradient placement and both are, or both are not,
        mixture-of-experts blocks: a dense model's blocks are one kind."""
        kind_of: dict[int, int] = {}
        kinds: dict[tuple, int] = {}
        firsts: list[tuple[ParamSpec, ...]] = []
        for layer, specs in self.params_of_layer.items():
            if layer is None:
                continue
            prefix = f"layers.{layer}."
            key = (
                self.is_moe(layer),
                tuple((p.name.removeprefix(prefix), p.shape, p.tp_dim, p.grad_tp_replicated) for p in specs),
            )
            if key not in kinds:
                kinds[key] = len(firsts)
                firsts.append(specs)
            kind_of[layer] = kinds[key]
        return kind_of, tuple(firsts)

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture-of-experts block."""
        return self.num_experts > 0 and layer >= self.n_dense_layers

    def matmul_params_per_layer(self, layer: int | None = None) -> int:
        """Weights one token meets in one block's matmuls (attention projections and SwiGLU; in
        an MoE block ``layer`` its router, top_k routed and the shared experts')."""
        if layer is not None and self.is_moe(layer):
            experts = self.top_k + self.num_shared_experts
            moe = 3 * self.dim * self.moe_ffn_dim * experts + self.dim * self.num_experts
            return self.attention_params() + moe
        return self.attention_params() + 3 * self.dim * self.ffn_dim

    @staticmethod
    def problem(model: nn.Module) -> str | None:
        """Why ``model`` has no shape: the declared sizes (`strategies.core.model_contract.SIZES`) it lacks,
        named with how to add them; None when it declares them all."""
        lacking = missing(model, SIZES)
        return member_problem(model, lacking, "model") if lacking else None

    @classmethod
    def of(cls, model: nn.Module) -> "ModelShape":
        """`from_model` of a model that declares the sizes.

        Raises:
            ModelContractError: ``model`` lacks a size; the message names it (`problem`).
        """
        problem = cls.problem(model)
        if problem is not None:
            raise ModelContractError(problem)
        return cls.from_model(model)

    @classmethod
    def from_model(cls, model: nn.Module) -> "ModelShape":
        """Reads sizes and parameters of ``model`` (a `trainer.models.llama.Llama`, any device).

        The tp dim of each parameter follows the model's ``tp_plan`` (none declared: every
        parameter replicated): column-wise Linear and row-wise Embedding shard dim 0, row-wise
        Linear and column-wise Embedding dim 1.
        """
        plan = model.tp_plan() if declares(model, "tp_plan") else {}
        specs, seen = [], set()
        for module_name, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:  # tied weights count once
                    continue
                seen.add(id(p))
                style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(module_name, pat)), None)
                embedding = isinstance(module, nn.Embedding)
                tp_dim = None
                if isinstance(style, ShardsOwnParams):  # e.g. the attention sinks, sharded by head
                    tp_dim = style.param_tp_dims.get(pname)
                elif isinstance(style, ColwiseParallel):
                    tp_dim = 1 if embedding else 0
                elif isinstance(style, RowwiseParallel) and (embedding or pname == "weight"):
                    tp_dim = 0 if embedding else 1  # a row-wise Linear's bias (wo's, GPT-OSS) is replicated
                parts = module_name.split(".")
                layer = int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None
                # Tied to the column-wise head, the embedding's gradient stays sharded (measured:
                # tests/dist/test_planner_memory.py's gemma3_tp2).
                replicated_grad = embedding and isinstance(style, RowwiseParallel) and not model.tie_embeddings
                specs.append(ParamSpec(f"{module_name}.{pname}", tuple(p.shape), tp_dim, layer, replicated_grad))
        return cls(
            vocab_size=model.vocab_size,
            dim=model.dim,
            n_layers=model.n_layers,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            ffn_dim=model.ffn_dim,
            tie_embeddings=model.tie_embeddings,
            params=tuple(specs),
            num_experts=optional(model, "num_experts"),
            top_k=optional(model, "top_k"),
            moe_ffn_dim=optional(model, "moe_ffn_dim"),
            num_shared_experts=optional(model, "num_shared_experts"),
            n_dense_layers=optional(model, "n_dense_layers"),
            linear_modules=tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear)),
            sliding_window=optional(model, "sliding_window"),
            window_layers=tuple(optional(model, "window_layers")),
            attention_sinks=optional(model, "attention_sinks"),
            expert_activation=optional(model, "expert_activation"),
            latent_attention=optional(model, "latent_attention"),
            head_size=optional(model, "head_dim"),
        )
