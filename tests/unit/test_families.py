"""The family registry (`trainer.models.families`): each entry's import and export directions agree."""

from __future__ import annotations

import pytest
import torch

from trainer.models.families import EXPORTABLE, FAMILIES, FamilyError, export_family_of, exportable, family_of
from trainer.models.llama import Llama
from trainer.models.moe_transformer import MoETransformer

SIZES = dict(vocab_size=16, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=8)
MOE = dict(num_experts=2, top_k=1, moe_ffn_dim=8)
CONFIG = {
    "num_experts_per_tok": 1,
    "num_experts": 2,
    "num_local_experts": 2,
    "moe_intermediate_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "no_rope_layers": [1, 0],  # SmolLM3: layer 1 without RoPE
    "sliding_window": 4,  # Gemma 3: layer 0 windowed, its own RoPE base
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 8,
    # DeepSeek-V3: latent attention without a query latent, a shared expert, 2 groups of 1 expert.
    **dict(n_shared_experts=1, q_lora_rank=None, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2),
    **dict(v_head_dim=4, n_group=2, topk_group=1),
}
FLAGS = (
    *("qkv_bias", "qk_norm", "qk_norm_scope", "norm_placement", "nope_layers", "norm_unit_offset", "scale_embeddings"),
    *("activation", "sliding_window", "window_layers", "rope_local_theta", "query_pre_attn_scalar"),
    *("attention_sinks", "o_bias", "biases", "expert_activation"),  # GPT-OSS
    *("latent_attention", "score_func", "num_shared_experts", "n_group", "topk_group"),
)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_family_reads_back_what_it_writes(model_type: str) -> None:
    family = FAMILIES[model_type]
    assert family_of({"model_type": model_type, "architectures": [family.architecture]}) == model_type
    kwargs = family.import_kwargs(CONFIG)
    flags = {k: v for k, v in kwargs.items() if k in FLAGS}
    model = family.model_class(**SIZES, **flags, **(MOE if family.moe else {}))
    assert family.fits(model)
    # Exported from a checkpoint of this family: written as it; a model of one's own: as the chosen family it fits.
    assert export_family_of(model, {"model_type": model_type, "architectures": [family.architecture]}) == model_type
    assert FAMILIES[export_family_of(model)].fits(model)
    assert export_family_of(model) == model_type or not family.chosen
    assert ("attention_bias" in family.export_fields(model)) != family.qkv_bias


def test_exportable_classes_come_from_the_registry() -> None:
    assert EXPORTABLE == (Llama, MoETransformer)
    assert exportable(type("Mine", (Llama,), {})) and not exportable(torch.nn.Linear)
    with torch.device("meta"):
        both = Llama(**SIZES, qk_norm=True, qkv_bias=True)
    with pytest.raises(FamilyError, match=r"qk_norm=True, qkv_bias=True \(Llama\) fit no Hugging Face architecture"):
        export_family_of(both)
    with (
        torch.device("meta"),
        pytest.raises(FamilyError, match=r"a llama model cannot be written as its source's qwen2"),
    ):
        export_family_of(Llama(**SIZES), {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def test_the_new_families_flags_pick_them_and_only_them() -> None:
    """A post-norm model with QK-norm per head, or one with NoPE layers and QK-norm, fits no
    family: the message names the flags; OLMo 2's and SmolLM3's own flags pick their family."""
    with torch.device("meta"):
        olmo2 = Llama(**SIZES, qk_norm=True, qk_norm_scope="projection", norm_placement="post")
        post_head = Llama(**SIZES, qk_norm=True, norm_placement="post")
        smollm3 = Llama(**SIZES, nope_layers=[1])
        nope_qwen3 = Llama(**SIZES, qk_norm=True, nope_layers=[0])
    assert (export_family_of(olmo2), export_family_of(smollm3)) == ("olmo2", "smollm3")
    assert export_family_of(Llama(**SIZES, nope_layers=[])) == "llama"  # no NoPE layer: a Llama
    with torch.device("meta"):
        windowed_llama = Llama(**SIZES, sliding_window=4, window_layers=[0])
    with pytest.raises(FamilyError, match=r"window_layers=\[0\] \(Llama\) fit no"):  # windows: Gemma 3's only
        export_family_of(windowed_llama)
    with pytest.raises(FamilyError, match=r"qk_norm=True, qkv_bias=False, norm_placement='post' \(Llama\) fit no"):
        export_family_of(post_head)
    with pytest.raises(FamilyError, match=r"qk_norm=True, qkv_bias=False, nope_layers=\[0\] \(Llama\) fit no"):
        export_family_of(nope_qwen3)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"norm_placement": "sandwiches"}, "norm_placement='sandwiches' is not one of pre, post, sandwich"),
        ({"qk_norm": True, "qk_norm_scope": "tensor"}, "qk_norm_scope='tensor' is not one of head, projection"),
        ({"nope_layers": [2]}, r"nope_layers=\[2\] must hold block indices in 0..1"),
        ({"window_layers": [0]}, "window_layers needs a sliding_window"),
        ({"activation": "relu"}, "activation='relu' is not one of silu, gelu_tanh"),
    ],
)
def test_the_new_flags_refuse_unknown_values(kwargs, named) -> None:
    with pytest.raises(ValueError, match=named):
        Llama(**SIZES, **kwargs)
