"""Qwen3-MoE, Mixtral and DeepSeek-V3 checkpoints made by ``transformers`` (tests/hf_checkpoints.py):
the plait model is a mixture of experts of the checkpoint's shape, and its export reloads bit for bit.

(The logits against transformers' within 1e-5 and transformers' reload of the export are checked
for every family in tests/unit/test_hf.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_checkpoints import batch, make_hf_dir, transformers

from trainer.data.tokenizer import Tokenizer
from trainer.export import write_hf_dir
from trainer.init_from import load_init_from
from trainer.models.hf import HFError, llama_from_hf
from trainer.models.moe_transformer import MoETransformer


def _load(directory, **router):
    model = llama_from_hf(str(directory), **router)
    load_init_from(model, str(directory))
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_export_round_trips_bit_exactly(family, tmp_path):
    make_hf_dir(family, tmp_path / "hf")
    model = _load(tmp_path / "hf")
    assert isinstance(model, MoETransformer)
    shape = {"qwen3_moe": (4, 2, 1), "mixtral": (4, 2, 0), "deepseek_v3": (8, 2, 1)}[family]
    assert (model.num_experts, model.top_k, model.n_dense_layers) == shape
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[tmp_path / "hf"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == family and config["num_experts_per_tok"] == 2
    again = _load(tmp_path / "out")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(again(batch()), model(batch()))


def test_router_knobs_reach_the_moe_and_are_refused_for_dense(tmp_path):
    make_hf_dir("mixtral", tmp_path / "moe")
    model = llama_from_hf(str(tmp_path / "moe"), balance_coef=1e-3, bias_update_rate=1e-3)
    moe = next(iter(model.moe_layers().values()))
    assert (moe.balance_coef, moe.bias_update_rate) == (1e-3, 1e-3)
    make_hf_dir("qwen3", tmp_path / "dense")
    with pytest.raises(HFError, match="model.balance_coef: .* is a dense model"):
        llama_from_hf(str(tmp_path / "dense"), balance_coef=1e-3)


def test_a_trained_expert_bias_is_not_exported_silently(tmp_path):
    make_hf_dir("mixtral", tmp_path / "hf")
    model = _load(tmp_path / "hf")
    next(iter(model.moe_layers().values())).router.expert_bias[0] = 0.5
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(HFError, match="non-zero expert bias"):
        write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    assert not (tmp_path / "out").exists()


def test_deepseek_v3_without_a_query_latent_and_its_routing_bias(tmp_path):
    """``q_lora_rank: null`` (one full query projection, DeepSeek-V2-Lite's layout): plait's logits
    are transformers' (1e-5) and so are those of transformers' reload of the export; the routing
    bias loads from ``e_score_correction_bias`` and steers the choice (without it the logits move)."""
    hf = make_hf_dir("deepseek_v3", tmp_path / "hf", q_lora_rank=None)
    model = _load(tmp_path / "hf")
    assert model.latent_attention["q_lora_rank"] == 0 and model.latent_attention["rope_interleave"]
    ids = batch()
    with torch.no_grad():
        expected = hf(ids).logits
        assert (model(ids) - expected).abs().max().item() < 1e-5
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[tmp_path / "hf"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(ids).logits, expected)
        biases = [moe.router.expert_bias for moe in model.moe_layers().values()]
        assert all(b.abs().min() > 0 for b in biases)  # every expert's, from the checkpoint
        for b in biases:
            b.zero_()
        assert (model(ids) - expected).abs().max().item() > 1e-3


def test_a_bfloat16_export_keeps_deepseek_v3s_routing_bias_in_float32(tmp_path):
    """``dtype=bfloat16`` casts the weights but not ``e_score_correction_bias`` nor the router's
    weight (transformers keeps both fp32): the bias's steps of the auxiliary-loss-free update (1e-3)
    would round away in bf16 near 0.1, and the router's scores differ from transformers' own bf16 save."""
    from safetensors import safe_open

    make_hf_dir("deepseek_v3", tmp_path / "hf")
    model = _load(tmp_path / "hf")
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[], dtype="bfloat16")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
        assert f.get_tensor("model.layers.1.mlp.experts.0.down_proj.weight").dtype == torch.bfloat16
    assert torch.equal(bias, model.layers["1"].feed_forward.router.expert_bias)
    assert torch.equal(router, model.layers["1"].feed_forward.router.gate.weight)


def test_deepseek_v3s_multi_token_prediction_block_is_skipped(tmp_path):
    """A checkpoint holding the MTP block (``model.layers.<num_hidden_layers>.*``, as DeepSeek-V3's
    own) loads as transformers loads it: the block left out; other unknown tensors still fail."""
    from safetensors.torch import save_file

    make_hf_dir("deepseek_v3", tmp_path / "hf")
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, str(tmp_path / "hf" / "mtp.safetensors"))
    _load(tmp_path / "hf")
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, str(tmp_path / "hf" / "mtp.safetensors"))
    with pytest.raises(HFError, match=r"no place for: model\.layers\.2\.eh_proj\.weight"):
        _load(tmp_path / "hf")


@pytest.mark.parametrize(
    "edits, named",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy' is not supported"),
        ({"n_group": 3}, "model.n_group=3 must divide model.num_experts=8"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"FineGrainedFP8Config\(dequantize=True\)"),
    ],
)
def test_deepseek_v3_configs_plait_cannot_route_are_refused(tmp_path, edits, named):
    make_hf_dir("deepseek_v3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **edits}))
    with pytest.raises(ValueError, match=named):
        llama_from_hf(str(tmp_path / "hf"))


def test_a_latent_attention_model_with_softmax_routing_is_not_exported_as_deepseek_v3(tmp_path):
    model = MoETransformer(
        vocab_size=300, dim=32, n_layers=2, n_heads=2, max_seq_len=16, num_experts=4, top_k=2, moe_ffn_dim=16,
        num_shared_experts=1, latent_attention=dict(q_lora_rank=0, kv_lora_rank=8, qk_nope_head_dim=8,
                                                     qk_rope_head_dim=4, v_head_dim=8),
    )  # fmt: skip
    make_hf_dir("deepseek_v3", tmp_path / "hf")
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(
        HFError, match=r"does not fit DeepseekV3ForCausalLM, .*: softmax scores \(DeepSeek-V3: sigmoid\)"
    ):
        write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])


def test_context_parallelism_is_refused_for_latent_attention_before_launch(tmp_path):
    """cp's attention cores carry keys and values of one width (DeepSeek-V3's values are narrower):
    strategy=cp is refused in validate naming strategy.cp=1; tp and expert parallelism pass."""
    from trainer.compose import compose
    from trainer.config import ConfigError, validate

    make_hf_dir("deepseek_v3", tmp_path / "hf")
    hf = ["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=32", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"strategy.cp=2: context parallelism is not built for latent attention"):
        validate(compose("pretrain", [*hf, "strategy=cp"]))
    validate(compose("pretrain", [*hf, "strategy=tp"]))
    validate(compose("pretrain", [*hf, "strategy=nd", "strategy.expert_parallel.ep=2"]))


def test_deepseek_v3_kv_cache_decoding_matches_transformers(tmp_path):
    """Decoding with the KV cache (a prompt of 5, then 1 token at a time; the cache holds latent
    attention's per-head keys and narrower values) gives transformers' logits at every position."""
    from trainer.models.kv_cache import kv_cache

    hf = make_hf_dir("deepseek_v3", tmp_path / "hf")
    model = _load(tmp_path / "hf")
    ids = batch(rows=1, seq_len=24)
    with torch.no_grad():
        expected = hf(ids).logits
        steps = []
        with kv_cache(model) as cache:
            for start, end in [(0, 5), *((t, t + 1) for t in range(5, 24))]:
                steps.append(model(ids[:, start:end], position_ids_bt=cache.position_ids(end - start)))
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() < 1e-5


def test_lora_targets_take_latent_attentions_hugging_face_names():
    """PEFT's names of DeepSeek-V3's attention (q_a_proj, kv_b_proj) select plait's wq_a and wkv_b."""
    from strategies.transforms.lora_targets import linear_layers, lora_targets, target_problems

    mla = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    model = MoETransformer(
        vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, num_experts=2, top_k=1, moe_ffn_dim=8,
        n_dense_layers=1, num_shared_experts=1, score_func="sigmoid", latent_attention=mla,
    )  # fmt: skip
    names = [n for n, _ in lora_targets(model, ["q_a_proj", "kv_b_proj"])]
    assert names == [f"layers.{i}.attention.{p}" for i in range(2) for p in ("wq_a", "wkv_b")]
    (problem,) = target_problems([n for n, _ in linear_layers(model)], ["k_proj"])
    assert "'q_a_proj'" in problem and "'kv_a_proj_with_mqa'" in problem


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        ("gpt_oss", "expert_bias", "a non-zero expert bias"),
        ("gpt_oss", "n_group", r"group-limited routing \(n_group > 1\)"),
        ("deepseek_v3", "clamped_swiglu", r"router and expert biases or the clamped SwiGLU \(GPT-OSS's\)"),
    ],
)
def test_what_the_family_cannot_hold_is_refused_not_dropped(tmp_path, family, edit, message):
    """A GPT-OSS model whose bias training moved its selection bias, or that routes within groups,
    and a DeepSeek-V3 model with GPT-OSS's clamped SwiGLU: each is refused before anything is
    written (they were exported, and transformers' reload gave other logits, 0.95 to 1.51 apart)."""
    make_hf_dir(family, tmp_path / "hf")
    model = _load(tmp_path / "hf")
    if edit == "expert_bias":
        next(iter(model.moe_layers().values())).router.expert_bias[0] = 0.01
    elif edit == "n_group":
        model.n_group = 2
    else:
        model.expert_activation = "clamped_swiglu"
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(HFError, match=f"does not fit .*ForCausalLM.*: {message}"):
        write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    assert not (tmp_path / "out").exists()
