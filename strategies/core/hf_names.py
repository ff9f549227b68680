"""The Hugging Face names of a Llama-style decoder's modules: the one table plait's import and
export (`trainer.models.hf`) and LoRA's ``target_modules`` (`strategies.transforms.lora_targets`) read.

plait's modules are ``tok_embeddings``, ``layers.<i>.attention.wq`` ... ``layers.<i>.feed_forward.w2``,
``norm`` and ``output``; transformers' Llama, Mistral and Qwen families name them
``model.embed_tokens``, ``model.layers.<i>.self_attn.q_proj`` ... ``model.layers.<i>.mlp.down_proj``,
``model.norm`` and ``lm_head`` (transformers ``modeling_llama.py``). A post-norm block's norms
(OLMo 2) have their own names (`POST_NORM_LAYER_NAMES`, transformers ``modeling_olmo2.py``): there
``post_attention_layernorm`` is the norm of the attention output, not Llama's norm before the MLP.
The routers and stacked experts of the mixture-of-experts families are named per family
(`trainer.models.hf_moe`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# plait module path inside a block -> the Hugging Face one.
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# The same for a post-norm block (OLMo 2): its two norms on the sublayers' outputs, no pre-norms.
POST_NORM_LAYER_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if k not in ("attention_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}
# The same for a sandwich block (Gemma 3): the pre-norms and the post-norms; its norm before the MLP
# is ``pre_feedforward_layernorm`` (transformers ``modeling_gemma3.py``).
SANDWICH_LAYER_NAMES = {
    **POST_NORM_LAYER_NAMES,
    "attention_norm": "input_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
}
# The same for a block of multi-head latent attention and shared experts (DeepSeek-V3, transformers
# ``modeling_deepseek_v3.py``): its query norm is the one of the query latent (``q_a_layernorm``).
LATENT_LAYER_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if k not in ("attention.wk", "attention.wv", "attention.k_norm")},
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "feed_forward.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "feed_forward.shared_experts.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared_experts.w2": "mlp.shared_experts.down_proj",
}
# plait module outside the blocks -> the Hugging Face one.
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_module_name(module: str, layer_names: Mapping[str, str] = LAYER_NAMES) -> str | None:
    """The Hugging Face name of plait module ``module`` (``layers.0.attention.wq`` ->
    ``model.layers.0.self_attn.q_proj``), or None for a module the table does not name.
    ``layer_names``: the block's table (`POST_NORM_LAYER_NAMES` for a post-norm family)."""
    if module in TOP_NAMES:
        return TOP_NAMES[module]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


def plait_module_name(module: str, layer_names: Mapping[str, str] = LAYER_NAMES) -> str | None:
    """The plait name of Hugging Face module ``module`` (the inverse of `hf_module_name`), or None."""
    for plait, hf in TOP_NAMES.items():
        if module == hf:
            return plait
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    inverse = {hf: plait for plait, hf in layer_names.items()}
    if match and match.group(2) in inverse:
        return f"layers.{match.group(1)}.{inverse[match.group(2)]}"
    return None
