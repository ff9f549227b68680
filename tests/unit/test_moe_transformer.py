"""The mixture-of-experts decoder (trainer.models.moe_transformer): presets, shape checks, logits
against ``transformers``' DeepSeek-V3 (latent attention, sigmoid routing with the expert bias,
shared experts, dense first blocks), metric sums and the expert-bias callback (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import compose_config
from hf_checkpoints import randomize, transformers
from omegaconf import OmegaConf

from trainer.callbacks.expert_bias import ExpertBiasUpdate
from trainer.config import ConfigError, validate
from trainer.model_node import instantiate_model
from trainer.models.moe_transformer import MoETransformer

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
TINY = dict(
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=32,
    num_experts=4,
    top_k=2,
    moe_ffn_dim=16,
    n_dense_layers=1,
    num_shared_experts=1,
)


def _meta(preset: str) -> MoETransformer:
    with torch.device("meta"):
        return instantiate_model(OmegaConf.load(CONF / f"{preset}.yaml"))


def _hf_meta(config_cls: str, **fields) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**fields))
    return sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_preset_has_the_published_parameter_counts():
    model = _meta("qwen3_30b_a3b")
    hf = _hf_meta(
        "Qwen3MoeConfig",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    )
    assert model.num_params() == hf == 30_532_122_624
    # Model card: 30.5B in total, 3.3B activated (3.35B, truncated).
    assert round(model.num_params() / 1e9, 1) == 30.5 and 3.3e9 <= model.num_active_params() < 3.4e9


def test_deepseek_v3_preset_has_the_published_parameter_counts():
    model = _meta("deepseek_v3_671b")
    hf = _hf_meta(
        "DeepseekV3Config",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        tie_word_embeddings=False,
    )
    assert model.num_params() == hf == 671_026_404_352
    # Report: 671B total, 37B activated per token (37.55B, truncated).
    assert round(model.num_params() / 1e9) == 671 and 37e9 <= model.num_active_params() < 38e9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": 5}, "top_k=5 exceeds model.num_experts=4; valid top_k: 1..4"),
        ({"n_dense_layers": 3}, "n_dense_layers=3 leaves no MoE block"),
        ({"score_func": "relu"}, "score_func='relu' is not one of softmax, sigmoid"),
        ({"latent_attention": {"kv_lora_rank": 8}}, "latent_attention.q_lora_rank must be an int"),
    ],
)
def test_bad_shapes_name_the_field(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        MoETransformer(**{**TINY, **change})


def _hf_deepseek_state(hf: torch.nn.Module, n_dense: int) -> dict[str, torch.Tensor]:
    """transformers' DeepSeek-V3 weights under plait's names (written out here, independently of plait)."""
    names = {
        "q_a_proj": "wq_a",
        "q_a_layernorm": "q_norm",
        "q_b_proj": "wq_b",
        "kv_a_proj_with_mqa": "wkv_a",
        "kv_a_layernorm": "kv_norm",
        "kv_b_proj": "wkv_b",
        "o_proj": "wo",
        "gate_proj": "w1",
        "up_proj": "w3",
        "down_proj": "w2",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    out = {}
    for name, t in hf.state_dict().items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "embed_tokens":
            out["tok_embeddings.weight"] = t
        elif parts[0] in ("norm", "lm_head"):
            out[f"{'output' if parts[0] == 'lm_head' else 'norm'}.weight"] = t
        elif parts[2] == "self_attn":
            out[f"layers.{parts[1]}.attention.{names[parts[3]]}.weight"] = t
        elif parts[2] in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{parts[1]}.{names[parts[2]]}.weight"] = t
        elif int(parts[1]) < n_dense:
            out[f"layers.{parts[1]}.feed_forward.{names[parts[3]]}.weight"] = t
        elif parts[3] == "gate":
            out[f"layers.{parts[1]}.feed_forward.router.{'gate.weight' if parts[4] == 'weight' else 'expert_bias'}"] = t
        elif parts[3] == "shared_experts":
            out[f"layers.{parts[1]}.feed_forward.shared_experts.{names[parts[4]]}.weight"] = t
        elif parts[4] == "gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            out[f"layers.{parts[1]}.feed_forward.experts.w1"], out[f"layers.{parts[1]}.feed_forward.experts.w3"] = (
                gate,
                up,
            )
        else:
            out[f"layers.{parts[1]}.feed_forward.experts.w2"] = t
    return out


@torch.no_grad()
def test_latent_attention_sigmoid_routing_and_shared_experts_match_transformers_deepseek_v3():
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=False,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(hf)
    for name, buffer in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.linspace(-0.05, 0.05, buffer.numel()))
    model = MoETransformer(
        vocab_size=64,
        dim=32,
        n_layers=3,
        n_heads=4,
        ffn_dim=48,
        max_seq_len=32,
        norm_eps=1e-6,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=16,
        n_dense_layers=1,
        num_shared_experts=1,
        score_func="sigmoid",
        route_scale=2.5,
        bias_update_rate=1e-3,
        latent_attention=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12),
    ).eval()
    model.load_state_dict(_hf_deepseek_state(hf, 1))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-5


def test_metric_sums_and_the_expert_bias_callback():
    torch.manual_seed(0)
    model = MoETransformer(**TINY, bias_update_rate=0.01)
    assert model.pop_sums()[1][1].sum().item() == 0  # nothing routed in backward yet: counts 0 (left out)
    model(torch.randint(0, 64, (2, 8))).float().square().mean().backward()
    names, sums = model.pop_sums()
    assert names[:4] == [f"moe/load/{i}" for i in range(4)] and names[4:] == ["moe/balance_loss", "moe/z_loss"]
    tokens = 2 * 8 * 2  # tokens x MoE blocks
    assert sums[1].tolist() == [tokens] * 6 and sums[0, :4].sum().item() == pytest.approx(4 * tokens)  # mean load 1
    loads = {name: moe.router.tokens_per_expert.clone() for name, moe in model.moe_layers().items()}
    strategy = SimpleNamespace(token_axis="dp_cp", all_reduce_sum=lambda t, axis: t.mul_(2))  # as if 2 equal ranks
    ExpertBiasUpdate().on_before_optimizer_step(SimpleNamespace(strategy=strategy), SimpleNamespace(model=model), None)
    for name, moe in model.moe_layers().items():
        expected = 0.01 * torch.sign(loads[name].mean() - loads[name])
        torch.testing.assert_close(moe.router.expert_bias, expected)
        assert moe.router.tokens_per_expert.sum().item() == 0


def test_flops_per_token_counts_the_active_experts_only():
    torch.manual_seed(0)
    model = MoETransformer(**TINY)
    D, V, L, T = 32, 64, 3, 16
    attn = D * 32 + 2 * D * 16 + 32 * D
    dense, moe = 3 * D * model.ffn_dim, 3 * D * 16 * (2 + 1) + D * 4
    assert model.flops_per_token(T) == 6 * (L * attn + dense + 2 * moe + D * V) + 12 * L * D * T


def test_the_planners_shape_counts_each_blocks_active_matmul_weights():
    from strategies.core.shape import ModelShape

    model = MoETransformer(**TINY)  # block 0 dense, blocks 1 and 2 MoE
    shape, T = ModelShape.from_model(model), 16
    per_token = sum(shape.matmul_params_per_layer(i) for i in range(shape.n_layers)) + shape.dim * shape.vocab_size
    assert [shape.is_moe(i) for i in range(3)] == [False, True, True]
    assert 6 * per_token + 12 * shape.n_layers * shape.dim * T == model.flops_per_token(T)


def test_a_bfloat16_cast_keeps_the_routers_buffers_float32():
    """model.to(bfloat16) (precision=bf16-true) casts the weights but not the routers' selection bias
    and token counts: a bias of 1.0 moved by 1e-3 (one update step) would round back to 1.0 in bf16."""
    torch.manual_seed(0)
    model = MoETransformer(**TINY, bias_update_rate=1e-3)
    moe = next(iter(model.moe_layers().values()))
    moe.router.expert_bias.fill_(1.001)
    moe.router.tokens_per_expert.fill_(257.0)
    model.to(torch.bfloat16)
    assert moe.router.gate.weight.dtype == torch.bfloat16
    assert torch.equal(moe.router.expert_bias, torch.full_like(moe.router.expert_bias, 1.001, dtype=torch.float32))
    assert moe.router.tokens_per_expert.dtype == moe.statistics.dtype == torch.float32
    assert bool((moe.router.tokens_per_expert == 257).all())
    model.to(torch.float32)  # and back: nothing lost
    assert bool((moe.router.expert_bias == torch.tensor(1.001)).all())


def test_local_sgd_with_the_expert_bias_is_refused() -> None:
    """Each island moved its bias from its own tokens and DiLoCo's synchronisations average
    parameters only: a reviewer's islands routed differently after a synchronised step."""
    overrides = ["model=deepseek_v3_tiny", "strategy=diloco", "trainer.devices=2", "data.seq_len=64"]
    with pytest.raises(ConfigError, match=r"model.bias_update_rate=0.001 moves each island's expert bias"):
        validate(compose_config(overrides))
    validate(compose_config([*overrides, "model.bias_update_rate=0"]))
