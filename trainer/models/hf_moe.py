"""The mixture-of-experts part of Hugging Face interop: Qwen3-MoE, Mixtral and DeepSeek-V3 checkpoints.

Both store each expert as three ``nn.Linear`` weights (Qwen3-MoE ``mlp.experts.<j>.{gate,up,down}_proj``,
Mixtral ``block_sparse_moe.experts.<j>.{w1,w3,w2}``) and the router as ``mlp.gate`` /
``block_sparse_moe.gate``; plait stacks the experts of a block into one ``[E, out, in]`` tensor per
projection (`trainer.models.moe.GroupedExperts`), so expert j of ``feed_forward.experts.w1`` is
the checkpoint's expert j gate projection. A rank that holds experts ``e0..e1`` (expert
parallelism) reads only those experts' tensors. Attention, norms and embeddings use the dense
names of `trainer.models.hf`, which imports this module (never the reverse).

DeepSeek-V3 (transformers ``modeling_deepseek_v3.py``) names its experts as Qwen3-MoE does, its router's
correction bias ``mlp.gate.e_score_correction_bias`` (plait's ``router.expert_bias`` buffer) and its
config the group-limited sigmoid routing and the latent attention's ranks (`moe_kwargs`). Its
multi-token-prediction block (``model.layers.<num_hidden_layers>``, ``num_nextn_predict_layers``)
is not built: transformers skips it on load too, and an export writes none.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from trainer.models import hf_gpt_oss as gpt_oss

_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "deepseek_v3": "mlp"}
_PROJ = {
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "deepseek_v3": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
_EXPERTS_FQN = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_ROUTER_FQN = re.compile(r"layers\.(\d+)\.feed_forward\.router\.(gate\.weight|expert_bias)")
# The families whose checkpoints hold the router's selection bias (plait name -> theirs).
_BIAS_NAME = {"deepseek_v3": "e_score_correction_bias"}
# The checkpoint names of those biases end so (an export keeps them in fp32).
EXPERT_BIAS_SUFFIX = tuple(f".gate.{name}" for name in _BIAS_NAME.values())
# Tensors transformers keeps in float32 whatever the checkpoint's dtype (its models'
# _keep_in_fp32_modules_strict): DeepSeek-V3's router, whose small score differences decide the experts.
FLOAT32_SUFFIXES = {"deepseek_v3": (*EXPERT_BIAS_SUFFIX, ".mlp.gate.weight")}
# transformers' DeepseekV3Config defaults of the fields a config.json may leave out.
_DEEPSEEK_DEFAULTS = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}


def num_experts_of(config: dict[str, Any]) -> int:
    return config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0


def holds_expert_bias(family: str) -> bool:
    """Whether the MoE ``family``'s checkpoints hold the router's selection bias (DeepSeek-V3)."""
    return family in _BIAS_NAME


def n_dense_layers_of(config: dict[str, Any]) -> int | None:
    """Qwen3-MoE's dense blocks as a leading count (``mlp_only_layers`` = 0..k-1), or None."""
    dense = sorted(config.get("mlp_only_layers") or [])
    return len(dense) if dense == list(range(len(dense))) else None


def moe_config_problems(config: dict[str, Any], family: str, where: str) -> list[str]:
    """What `MoETransformer` cannot reproduce in a Qwen3-MoE or Mixtral config."""
    problems = []
    if family == "qwen3_moe":
        if config.get("decoder_sparse_step", 1) != 1:
            step = config["decoder_sparse_step"]
            problems.append(f"{where}: decoder_sparse_step={step} is not supported (every block MoE)")
        if n_dense_layers_of(config) is None:
            dense = config["mlp_only_layers"]
            problems.append(f"{where}: mlp_only_layers={dense} is not supported (only the first k blocks dense)")
    if family == "deepseek_v3":
        for field, ok, why in [
            ("scoring_func", "sigmoid", "sigmoid scores"),
            ("topk_method", "noaux_tc", "groups scored by their top-2 biased scores"),
            ("moe_layer_freq", 1, "every block after the first_k_dense_replace dense ones MoE"),
        ]:
            if config.get(field, ok) != ok:
                problems.append(f"{where}: {field}={config[field]!r} is not supported ({why})")
    if config.get("router_jitter_noise", 0.0):
        noise = config["router_jitter_noise"]
        problems.append(f"{where}: router_jitter_noise={noise} is not supported (no router noise)")
    if num_experts_of(config) < config.get("num_experts_per_tok", 1):
        problems.append(f"{where}: num_experts_per_tok exceeds the number of experts")
    return problems


def moe_kwargs(config: dict[str, Any], family: str) -> dict[str, Any]:
    """`MoETransformer` arguments beyond the Llama ones of a (supported) config."""
    if family == "deepseek_v3":
        return deepseek_kwargs(config)
    if family == "gpt_oss":
        return gpt_oss.moe_kwargs(config)
    qwen = family == "qwen3_moe"
    return {
        "num_experts": num_experts_of(config),
        "top_k": config["num_experts_per_tok"],
        "moe_ffn_dim": config["moe_intermediate_size"] if qwen else config["intermediate_size"],
        "n_dense_layers": n_dense_layers_of(config) if qwen else 0,
        "score_func": "softmax",
        "norm_topk": bool(config.get("norm_topk_prob", False)) if qwen else True,
    }


def deepseek_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`MoETransformer` arguments of a DeepSeek-V3 config: sigmoid group-limited routing, shared
    experts, the first dense blocks and latent attention (``q_lora_rank`` None: 0, a full query)."""
    get = {k: config.get(k, v) for k, v in _DEEPSEEK_DEFAULTS.items()}
    return {
        "num_experts": num_experts_of(config),
        "top_k": config["num_experts_per_tok"],
        "moe_ffn_dim": config["moe_intermediate_size"],
        "n_dense_layers": config.get("first_k_dense_replace") or 0,
        "num_shared_experts": config.get("n_shared_experts") or 0,
        "score_func": "sigmoid",
        "norm_topk": bool(get["norm_topk_prob"]),
        "route_scale": float(get["routed_scaling_factor"]),
        "n_group": get["n_group"] or 1,
        "topk_group": get["topk_group"] or 1,
        "latent_attention": {
            "q_lora_rank": config.get("q_lora_rank") or 0,
            "kv_lora_rank": config["kv_lora_rank"],
            "qk_nope_head_dim": config["qk_nope_head_dim"],
            "qk_rope_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"],
            "rope_interleave": bool(config.get("rope_interleave", True)),
        },
    }


# ---------------------------------------------------------------------------------------------- names
def router_hf_name(fqn: str, family: str) -> str | None:
    """``layers.<i>.feed_forward.router.gate.weight`` (or ``.expert_bias``, in a family that holds
    it) -> the checkpoint's router tensor, else None."""
    if family == "gpt_oss":
        return gpt_oss.router_hf_name(fqn)
    match = _ROUTER_FQN.fullmatch(fqn)
    if not match or (match.group(2) == "expert_bias" and family not in _BIAS_NAME):
        return None
    leaf = "weight" if match.group(2) == "gate.weight" else _BIAS_NAME[family]
    return f"model.layers.{match.group(1)}.{_BLOCK[family]}.gate.{leaf}"


def expert_hf_names(fqn: str, family: str, experts: range) -> list[str] | None:
    """The per-expert tensor names of a stacked expert parameter, for ``experts``; None if ``fqn``
    is not one (``layers.<i>.feed_forward.experts.w1`` -> ``...experts.<j>.gate_proj.weight``)."""
    if family == "gpt_oss":  # fused stacked tensors: hf_gpt_oss.expert_source
        return None
    match = _EXPERTS_FQN.fullmatch(fqn)
    if not match:
        return None
    layer, proj = match.group(1), _PROJ[family][match.group(2)]
    return [f"model.layers.{layer}.{_BLOCK[family]}.experts.{j}.{proj}.weight" for j in experts]


def moe_plait_name(name: str, family: str) -> str | None:
    """The plait FQN a checkpoint's router or expert tensor feeds (experts: the stacked tensor)."""
    if family == "gpt_oss":
        return gpt_oss.plait_name(name)
    block = re.escape(_BLOCK[family])
    match = re.fullmatch(rf"model\.layers\.(\d+)\.{block}\.gate\.weight", name)
    if match:
        return f"layers.{match.group(1)}.feed_forward.router.gate.weight"
    if family in _BIAS_NAME:
        match = re.fullmatch(rf"model\.layers\.(\d+)\.{block}\.gate\.{_BIAS_NAME[family]}", name)
        if match:
            return f"layers.{match.group(1)}.feed_forward.router.expert_bias"
    match = re.fullmatch(rf"model\.layers\.(\d+)\.{block}\.experts\.\d+\.(\w+)\.weight", name)
    inverse = {hf: plait for plait, hf in _PROJ[family].items()}
    if match and match.group(2) in inverse:
        return f"layers.{match.group(1)}.feed_forward.experts.{inverse[match.group(2)]}"
    return None


# ---------------------------------------------------------------------------------------------- export
def moe_export_problems(model: Any, family: str) -> list[str]:
    """The features of ``model`` that the MoE ``family`` (``qwen3_moe``, ``mixtral`` or
    ``deepseek_v3``, chosen by `trainer.models.families.export_family_of`) cannot hold; [] when it
    can be written."""
    if family == "deepseek_v3":
        problems = ["softmax scores (DeepSeek-V3: sigmoid)"] if model.score_func != "sigmoid" else []
        if not model.num_shared_experts:
            problems.append("no shared expert (model.num_shared_experts=0; DeepSeek-V3 has at least 1)")
        if model.biases or model.expert_activation != "silu":
            problems.append("router and expert biases or the clamped SwiGLU (GPT-OSS's)")
        return problems + (["q/k/v biases"] if model.qkv_bias else [])
    # Shared by the other families: none routes within groups or holds a selection bias (DeepSeek-V3's).
    problems = ["group-limited routing (n_group > 1)"] if model.n_group > 1 else []
    # the trained bias: unknown on the meta device (validate's check: trained weights are checked at export)
    biases = [moe.router.expert_bias for moe in model.moe_layers().values()]
    if any(not bias.is_meta and bool(bias.any()) for bias in biases):
        problems.append("a non-zero expert bias (trained with bias_update_rate > 0)")
    if family == "gpt_oss":
        return problems + gpt_oss.export_problems(model)
    if model.biases or model.expert_activation != "silu":
        problems.append("router and expert biases or the clamped SwiGLU (GPT-OSS's)")
    if model.num_shared_experts or model.score_func != "softmax" or model.route_scale != 1.0 or model.qkv_bias:
        problems.append("shared experts, sigmoid scores, route_scale != 1 and q/k/v biases")
    if family == "mixtral" and (model.n_dense_layers or not model.norm_topk):
        problems.append("dense blocks and unnormalised top-k weights without qk_norm (Mixtral)")
    return problems


def moe_config_fields(model: Any, family: str) -> dict[str, Any]:
    """The MoE fields of a ``config.json`` for ``model`` (see `moe_export_problems`)."""
    fields: dict[str, Any] = {"num_experts_per_tok": model.top_k, "output_router_logits": False}
    if family == "gpt_oss":
        return gpt_oss.config_fields(model)
    if family == "deepseek_v3":
        mla = model.latent_attention
        fields.update(
            n_routed_experts=model.num_experts,
            moe_intermediate_size=model.moe_ffn_dim,
            n_shared_experts=model.num_shared_experts,
            first_k_dense_replace=model.n_dense_layers,
            n_group=model.n_group,
            topk_group=model.topk_group,
            routed_scaling_factor=model.route_scale,
            norm_topk_prob=model.norm_topk,
            q_lora_rank=mla["q_lora_rank"] or None,
            **{k: mla[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
            head_dim=mla["qk_rope_head_dim"],  # transformers' DeepseekV3Config: the RoPE's width
            qk_head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
            rope_interleave=bool(mla.get("rope_interleave", False)),
            num_key_value_heads=model.n_heads,
            num_nextn_predict_layers=0,  # no multi-token-prediction block is written
        )
    elif family == "qwen3_moe":
        fields.update(
            num_experts=model.num_experts,
            moe_intermediate_size=model.moe_ffn_dim,
            intermediate_size=model.ffn_dim,
            norm_topk_prob=model.norm_topk,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(model.n_dense_layers)),
        )
    else:
        fields.update(num_local_experts=model.num_experts, intermediate_size=model.moe_ffn_dim, router_jitter_noise=0.0)
    return fields


def split_experts(fqn: str, tensor: torch.Tensor, family: str) -> dict[str, torch.Tensor] | None:
    """A full stacked expert tensor ``[E, out, in]`` as the checkpoint's E tensors; None if not one."""
    names = expert_hf_names(fqn, family, range(tensor.shape[0]))
    return None if names is None else {n: tensor[j].contiguous() for j, n in enumerate(names)}
