"""Tiny random Hugging Face checkpoints written by ``transformers`` (the independent reference).

Each family's config is as small as a CPU test allows while still exercising what sets it apart:
GQA and llama3 RoPE scaling (Llama 3), tied embeddings and linear scaling without GQA (Llama 2),
q/k/v biases and YaRN (Qwen2), QK-norm and a head dim other than hidden/heads (Qwen3), a
sliding window longer than the context (Mistral), routed experts with a dense first block (Qwen3-MoE),
renormalised top-2 routing (Mixtral), post-norm blocks with QK-norm over whole projections (OLMo 2)
a layer without RoPE between two with it (SmolLM3), and sandwich norms, sliding windows shorter than
the rows and a local RoPE base (Gemma 3), and latent attention with interleaved YaRN RoPE, a dense
first block, shared experts and sigmoid routing limited to 2 of 4 expert groups (DeepSeek-V3). Every
parameter, biases and norm scales included, is drawn at random, and so is DeepSeek-V3's routing
correction bias (a buffer), so a wrong mapping cannot hide behind a default init.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is the reference for HF checkpoints"
)

VOCAB = 300  # even, so tp=2 divides the embedding rows
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                               "rope_theta": 500000.0}),
    "llama2": ("LlamaConfig", {"num_key_value_heads": 4, "tie_word_embeddings": True,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2": ("Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": 256}),
    # Mixtures of experts: 4 experts, top-2; Qwen3-MoE with its first block dense and normalised top-k.
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "moe_intermediate_size": 48, "num_experts": 4,
                                     "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}),
    "olmo2": ("Olmo2Config", {}),
    # no_rope_layer_interval=2 over 3 layers: config.json's no_rope_layers = [1, 0, 1] (layer 1 is NoPE).
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 3, "no_rope_layer_interval": 2, "pad_token_id": None,
                                  "bos_token_id": None, "eos_token_id": None}),
    # Gemma 3: windows of 8 tokens (shorter than the rows) in layers 0 and 2, layer 1 global with linear
    # RoPE scaling; local base 10000; query_pre_attn_scalar != head_dim.
    "gemma3_text": ("Gemma3TextConfig", {"num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24,
                                         "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention",
                                                                              "sliding_attention"],
                                         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                "rope_theta": 1e6},
                                                             "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 1e4}}}),
    # DeepSeek-V3: block 0 dense, blocks 1-2 of 8 sigmoid-routed experts (top-2 within the best 2 of
    # 4 groups) plus a shared one; latent attention with a query latent, rotated pairs interleaved,
    # YaRN whose mscale_all_dim also scales the softmax (mscale != mscale_all_dim: attention_factor != 1).
    "deepseek_v3": ("DeepseekV3Config", {"num_hidden_layers": 3, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                                         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                                         "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 24,
                                         "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                         "v_head_dim": 12, "rope_interleave": True,
                                         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                             "original_max_position_embeddings": 32,
                                                             "mscale": 1.0, "mscale_all_dim": 0.8}}),
    # GPT-OSS: windows of 8 tokens (shorter than the rows) in layers 0 and 2, layer 1 full; sinks, q/k/v/o
    # biases, 4 experts top-2 with router and expert biases; swiglu_limit 0.3 so the clamps bind
    # (gate and up of std ~0.4 here); YaRN without truncation (GPT-OSS's).
    "gpt_oss": ("GptOssConfig", {"num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 48, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "sliding_window": 8, "swiglu_limit": 0.3,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                     "original_max_position_embeddings": 32}}),
}  # fmt: skip


def corpus_texts() -> list[str]:
    words = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE of ``VOCAB`` ids (plait's trainer) with a Qwen-like chat template beside it."""
    from trainer.data.tokenizer import train_bpe

    tok = train_bpe(corpus_texts(), vocab_size=VOCAB)
    assert tok.vocab_size <= VOCAB
    tok.save(directory / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random: weights and biases ~ N(0, 0.05), norm scales ~ 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, of the scores' spread
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def make_hf_dir(family: str, directory: Path, *, seed: int = 0, **overrides: Any) -> Any:
    """Saves a random ``family`` model (fp32, safetensors) and a tokenizer in ``directory``; returns the model."""
    config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def batch(seed: int = 0, rows: int = 2, seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
