"""Unit tests for trainer.models.llama (CPU, a few seconds)."""

import math

import pytest
import torch

from trainer.models.block import llama_ffn_dim
from trainer.models.document_masks import block_causal_mask
from trainer.models.llama import Llama

VOCAB = 97
NANO = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def make(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(**{**NANO, **overrides}).eval()


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_dtype():
    model = make()
    logits = model(ids(3, 10))
    assert logits.shape == (3, 10, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()

    model_bf16 = make().to(torch.bfloat16)
    assert model_bf16(ids(2, 5)).dtype == torch.bfloat16


def test_ffn_dim_default_follows_llama_rule():
    assert llama_ffn_dim(64) == 192  # int(170.67) = 170 -> 192
    assert llama_ffn_dim(4096) == 10944  # int(10922.67) = 10922 -> 10944
    assert llama_ffn_dim(96) == 256  # exactly 256, no rounding
    model = make()
    assert model.ffn_dim == 192
    assert model.layers["0"].feed_forward.w1.weight.shape == (192, 64)
    assert make(ffn_dim=100).layers["1"].feed_forward.w2.weight.shape == (64, 100)


def test_module_names():
    names = set(dict(make().named_parameters()))
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "attention_norm.weight", p + "ffn_norm.weight"}
        expected |= {p + f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {p + f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    assert names == expected
    assert make().layers["0"].attention.wk.weight.shape == (2 * 16, 64)  # n_kv_heads * head_dim
    # RoPE tables are buffers, but not part of checkpoints.
    assert "rope_cos" not in make().state_dict()


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = make(n_kv_heads=2)
    mha = make(n_kv_heads=4)
    rep, head_dim = 2, 16
    state = gqa.state_dict()
    for key, w in list(state.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # [K*E, D] -> [K, E, D] -> each kv head repeated for its query heads.
            state[key] = w.view(2, head_dim, -1).repeat_interleave(rep, dim=0).reshape(4 * head_dim, -1)
    mha.load_state_dict(state)
    x = ids(2, 12)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)
    # Repeating the kv heads in the other order (tile) must not match.
    tiled = {k: v.clone() for k, v in gqa.state_dict().items()}
    for key in tiled:
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            tiled[key] = gqa.state_dict()[key].repeat(rep, 1)
    mha.load_state_dict(tiled)
    assert (gqa(x) - mha(x)).abs().max() > 1e-3


def test_tied_embeddings_share_storage():
    tied = make(tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    untied = make(tie_embeddings=False)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert tied.num_params() == untied.num_params() - VOCAB * 64
    assert untied.num_params(exclude_embeddings=True) == untied.num_params() - VOCAB * 64
    # A gradient step through the output layer moves the embedding too.
    tied.train()
    tied(ids(1, 4)).sum().backward()
    assert tied.tok_embeddings.weight.grad is tied.output.weight.grad


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(dim=66), "n_heads"),  # 66 % 4 != 0
        (dict(n_kv_heads=3), "n_kv_heads"),  # 4 % 3 != 0
        (dict(dim=12, n_heads=4, n_kv_heads=4), "even"),  # head_dim 3
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=0), "n_layers"),
        (dict(ffn_dim=-1), "ffn_dim"),
        (dict(max_seq_len=0), "max_seq_len"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(norm_eps=-1e-6), "norm_eps"),
        (dict(init_std=0.0), "init_std"),
    ],
)
def test_constructor_errors(overrides, field):
    with pytest.raises(ValueError, match=field):
        Llama(**{**NANO, **overrides})


def test_forward_errors():
    model = make()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(ids(1, 33))
    with pytest.raises(ValueError, match="document_ids_bt"):
        model(ids(2, 8), document_ids_bt=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids_bt"):
        model(ids(2, 8), position_ids_bt=torch.arange(8))


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_packed_documents_are_isolated():
    model = make()
    doc_a, doc_b = ids(1, 3, seed=2), ids(1, 5, seed=3)
    packed = torch.cat([doc_a, doc_b], dim=1)
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])

    with torch.no_grad():
        packed_logits = model(packed, position_ids_bt=position_ids, document_ids_bt=document_ids)
        alone_b = model(doc_b)
        alone_a = model(doc_a)
        other_a = torch.cat([(doc_a + 1) % VOCAB, doc_b], dim=1)
        other_logits = model(other_a, position_ids_bt=position_ids, document_ids_bt=document_ids)
        unmasked = model(packed)

    assert (packed_logits[:, 3:] - alone_b).abs().max() < 1e-5
    assert (packed_logits[:, :3] - alone_a).abs().max() < 1e-5
    assert torch.equal(packed_logits[:, 3:], other_logits[:, 3:])
    assert (packed_logits[:, :3] - other_logits[:, :3]).abs().max() > 1e-3  # A did change
    # Without the document mask, B sees A: the mask is what isolates them.
    assert (unmasked[:, 3:] - alone_b).abs().max() > 1e-3


def test_single_document_equals_causal_fast_path():
    model = make()
    x = ids(2, 16)
    with torch.no_grad():
        fast = model(x)
        masked = model(x, document_ids_bt=torch.zeros(2, 16, dtype=torch.long))
        with_positions = model(x, position_ids_bt=torch.arange(16).expand(2, 16))
    assert (fast - masked).abs().max() < 1e-6
    assert (fast - with_positions).abs().max() < 1e-6


def test_causal_and_rope_relative():
    model = make()
    x = ids(1, 10)
    changed = x.clone()
    changed[0, 7] = (changed[0, 7] + 1) % VOCAB
    with torch.no_grad():
        base = model(x)
        after = model(changed)
        shifted = model(x, position_ids_bt=torch.arange(10)[None] + 9)
        reversed_pos = model(x, position_ids_bt=torch.arange(9, -1, -1)[None])
    assert torch.equal(base[:, :7], after[:, :7])  # the past never sees the future
    assert (base[:, 7:] - after[:, 7:]).abs().max() > 1e-3
    # RoPE depends only on relative positions: a constant shift changes nothing...
    assert (base - shifted).abs().max() < 1e-4
    # ...but positions do matter.
    assert (base - reversed_pos).abs().max() > 1e-3


def test_pipeline_stages_compose_to_full_model():
    full = make(n_layers=4)
    first, last = make(n_layers=4), make(n_layers=4)
    for key in ("2", "3"):
        del first.layers[key]
    for key in ("0", "1"):
        del last.layers[key]
    first.norm = first.output = None
    last.tok_embeddings = None
    # FQNs of kept blocks are unchanged.
    assert {k for k in dict(last.named_parameters()) if k.startswith("layers.")} == {
        k for k in dict(full.named_parameters()) if k.startswith(("layers.2.", "layers.3."))
    }
    x = ids(2, 8)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    with torch.no_grad():
        hidden = first(x, position_ids_bt=pos, document_ids_bt=docs)
        assert hidden.shape == (2, 8, 64)
        staged = last(hidden, position_ids_bt=pos, document_ids_bt=docs)
        expected = full(x, position_ids_bt=pos, document_ids_bt=docs)
    assert staged.shape == (2, 8, VOCAB)
    torch.testing.assert_close(staged, expected, atol=1e-6, rtol=1e-6)


def test_construction_is_deterministic():
    a, b, c = make(seed=0), make(seed=0), make(seed=1)
    for (key, wa), (_, wb), (_, wc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(wa, wb), key
        if not key.endswith("norm.weight"):
            assert not torch.equal(wa, wc), key


def test_init_weights_statistics():
    model = make(dim=256, n_layers=8, n_heads=8, n_kv_heads=8, init_std=0.02)
    std = lambda t: t.float().std().item()  # noqa: E731
    assert std(model.tok_embeddings.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers["3"].attention.wq.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers["3"].feed_forward.w1.weight) == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 8)
    assert std(model.layers["3"].attention.wo.weight) == pytest.approx(residual, rel=0.05)
    assert std(model.layers["3"].feed_forward.w2.weight) == pytest.approx(residual, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.layers["0"].ffn_norm.weight, torch.ones(256))


def test_meta_device_then_init_weights_matches_cpu():
    torch.manual_seed(5)
    with torch.device("meta"):
        meta_model = Llama(**NANO)
    assert meta_model.tok_embeddings.weight.is_meta
    meta_model.to_empty(device="cpu")
    meta_model.init_weights()
    cpu_model = make(5)
    for (key, a), (_, b) in zip(meta_model.state_dict().items(), cpu_model.state_dict().items()):
        assert torch.equal(a, b), key
    assert torch.equal(meta_model.rope_cos, cpu_model.rope_cos)
    assert torch.equal(meta_model.rope_sin, cpu_model.rope_sin)
    x = ids(1, 6)
    torch.testing.assert_close(meta_model(x), cpu_model(x), atol=0, rtol=0)


def test_rope_tables_stay_float32_after_cast():
    model = make(max_seq_len=4096).to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32
    assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    angle = 4095 * 1.0  # position 4095, frequency index 0 (inv_freq = 1)
    assert model.rope_cos[4095, 0].item() == pytest.approx(math.cos(angle), abs=1e-4)


def test_flops_per_token_matches_formula():
    model = make()  # dim 64, 2 layers, 4 heads, 2 kv heads (head_dim 16), ffn 192
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192  # wq, wk+wv, wo, w1+w2+w3
    n_matmul = 2 * per_layer + 64 * VOCAB  # + output projection
    assert n_matmul == 104512
    assert model.flops_per_token(32) == 6 * n_matmul + 12 * 2 * 64 * 32
    # Cross-check against the actual Linear layers of the module.
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.flops_per_token(100) == 6 * n_linear + 12 * 2 * 64 * 100
    # Tied output still costs a matmul.
    assert make(tie_embeddings=True).flops_per_token(32) == model.flops_per_token(32)
    assert model.flops_per_token(1) > 0
    with pytest.raises(ValueError, match="seq_len"):
        model.flops_per_token(0)
