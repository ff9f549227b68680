"""GPT-OSS's router and expert tensors in Hugging Face checkpoints (transformers ``modeling_gpt_oss.py``).

Where Qwen3-MoE and Mixtral store each expert as ``nn.Linear`` weights, GPT-OSS stores a block's
experts as fused stacked tensors, input-major: ``mlp.experts.gate_up_proj`` ``[E, D, 2F]`` (gate and
up interleaved along the last dim: the gate at even, the up projection at odd columns),
``gate_up_proj_bias`` ``[E, 2F]``, ``down_proj`` ``[E, F, D]`` and ``down_proj_bias`` ``[E, D]``; its
router is ``mlp.router.weight`` ``[E, D]`` and ``mlp.router.bias`` ``[E]``. plait's
`trainer.models.moe.GroupedExperts` holds ``w1`` (gate), ``w3`` (up) ``[E, F, D]``, ``w2``
``[E, D, F]`` and ``w1_bias``, ``w3_bias`` ``[E, F]``, ``w2_bias`` ``[E, D]``. A rank that holds
experts ``e0..e1`` reads those rows of the fused tensor only. `trainer.models.hf_moe` calls these.

The checkpoints OpenAI publishes hold the experts in MXFP4; plait reads their bf16 form (a
``config.json`` with ``quantization_config`` is refused, `trainer.models.hf.config_problems`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_EXPERT_FQN = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])(_bias)?")
_ROUTER_FQN = re.compile(r"layers\.(\d+)\.feed_forward\.router\.gate\.(weight|bias)")
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_ROUTER_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)")


def router_hf_name(fqn: str) -> str | None:
    """``layers.<i>.feed_forward.router.gate.{weight,bias}`` -> ``model.layers.<i>.mlp.router.{weight,bias}``."""
    match = _ROUTER_FQN.fullmatch(fqn)
    return f"model.layers.{match.group(1)}.mlp.router.{match.group(2)}" if match else None


def plait_name(name: str) -> str | None:
    """The plait FQN a checkpoint's router or fused expert tensor feeds (``gate_up_proj``: ``w1``)."""
    match = _ROUTER_NAME.fullmatch(name)
    if match:
        return f"layers.{match.group(1)}.feed_forward.router.gate.{match.group(2)}"
    match = _EXPERT_NAME.fullmatch(name)
    if match:
        w = "w1" if match.group(2) == "gate_up_proj" else "w2"
        return f"layers.{match.group(1)}.feed_forward.experts.{w}{match.group(3) or ''}"
    return None


def expert_source(
    fqn: str, shape: tuple[int, ...]
) -> tuple[str, list[int], Callable[[torch.Tensor], torch.Tensor]] | None:
    """Where a stacked expert parameter of global ``shape`` lives in the checkpoint: the fused
    tensor's name, its shape, and the function that turns rows ``[J, ...]`` of it into the
    parameter's ``[J, ...]`` (the gate's even or the up projection's odd columns, transposed to
    ``[out, in]``); None when ``fqn`` is not an expert tensor."""
    match = _EXPERT_FQN.fullmatch(fqn)
    if not match:
        return None
    layer, w, bias = match.group(1), match.group(2), bool(match.group(3))
    fused = f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}{'_bias' if bias else ''}"
    if w == "w2":
        hf_shape = list(shape) if bias else [shape[0], shape[2], shape[1]]
        return fused, hf_shape, (lambda t: t) if bias else (lambda t: t.transpose(1, 2))
    column = 0 if w == "w1" else 1  # gate_up[..., ::2] is the gate, [..., 1::2] the up projection
    hf_shape = [shape[0], 2 * shape[1]] if bias else [shape[0], shape[2], 2 * shape[1]]
    if bias:
        return fused, hf_shape, lambda t: t[..., column::2]
    return fused, hf_shape, lambda t: t[..., column::2].transpose(1, 2)


def hf_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A full plait state dict's routers and experts as the checkpoint's tensors (gate and up
    interleaved into ``gate_up_proj``), and the rest of the state, for the dense names."""
    out, rest = {}, {}
    for fqn, tensor in state.items():
        router, expert = router_hf_name(fqn), _EXPERT_FQN.fullmatch(fqn)
        if router is not None:
            out[router] = tensor.contiguous()
        elif expert is None:
            rest[fqn] = tensor
        elif expert.group(2) == "w2":
            down = tensor if expert.group(3) else tensor.transpose(1, 2)
            out[f"model.layers.{expert.group(1)}.mlp.experts.down_proj{expert.group(3) or ''}"] = down.contiguous()
        elif expert.group(2) == "w1":  # with its w3: [..., F, 2] -> [..., 2F], the gate first in each pair
            bias = expert.group(3) or ""
            up = state[fqn.replace("w1", "w3")]
            gate_up = torch.stack([tensor, up], dim=-2 if not bias else -1)
            if not bias:  # [E, F, 2, D] -> [E, D, F, 2] -> [E, D, 2F]
                gate_up = gate_up.permute(0, 3, 1, 2)
            out[f"model.layers.{expert.group(1)}.mlp.experts.gate_up_proj{bias}"] = gate_up.reshape(
                *gate_up.shape[:-2], -1
            ).contiguous()
    return out, rest


def moe_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """`MoETransformer` arguments of a GPT-OSS config: softmax over each token's top-k logits
    (plait's renormalised top-k softmax), router and expert biases, the clamped SwiGLU."""
    return {
        "num_experts": config["num_local_experts"],
        "top_k": config["num_experts_per_tok"],
        "moe_ffn_dim": config["intermediate_size"],
        "n_dense_layers": 0,
        "score_func": "softmax",
        "norm_topk": True,
        "biases": True,
        "expert_activation": "clamped_swiglu",
        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
    }


def export_problems(model: Any) -> list[str]:
    """What a model written as GPT-OSS must have and ``model`` lacks."""
    problems = []
    if not (model.biases and model.expert_activation == "clamped_swiglu"):
        problems.append("GPT-OSS's experts: router and expert biases with the clamped SwiGLU (model.biases=true, "
                        "model.expert_activation=clamped_swiglu)")  # fmt: skip
    if model.n_dense_layers or not model.norm_topk or model.num_shared_experts or model.score_func != "softmax":
        problems.append("dense blocks, shared experts, sigmoid scores or unnormalised top-k weights (GPT-OSS)")
    if model.route_scale != 1.0:
        problems.append(f"route_scale={model.route_scale} (GPT-OSS: 1)")
    return problems


def config_fields(model: Any) -> dict[str, Any]:
    """The MoE fields of a GPT-OSS ``config.json`` for ``model``."""
    return {
        "num_local_experts": model.num_experts,
        "num_experts_per_tok": model.top_k,
        "intermediate_size": model.moe_ffn_dim,
        "swiglu_alpha": model.swiglu_alpha,
        "swiglu_limit": model.swiglu_limit,
        "output_router_logits": False,
    }
