"""Hugging Face checkpoints in and out: each family against ``transformers``, fp32.

Per family (tests/hf_checkpoints.py): transformers builds a small random model and saves it;
plait loads the directory and its logits on a fixed batch match transformers' within 1e-5; plait
exports it back and transformers loads the export with bitwise identical logits. Unsupported
fields fail in ``validate`` with a message naming the field.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hf_checkpoints import FAMILIES, batch, make_hf_dir, transformers

from trainer.config import ConfigError, validate
from trainer.data.tokenizer import Tokenizer
from trainer.export import write_hf_dir
from trainer.init_from import load_init_from
from trainer.models.hf import llama_from_hf
from trainer.models.llama import Llama

TOL = 1e-5


def _plait(directory) -> Llama:
    model = llama_from_hf(str(directory))
    load_init_from(model, str(directory))
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_load_matches_transformers_and_export_round_trips(family, tmp_path):
    hf = make_hf_dir(family, tmp_path / "hf")
    ids = batch()
    with torch.no_grad():
        expected = hf(ids).logits
        model = _plait(tmp_path / "hf")
        got = model(ids)
    assert (got - expected).abs().max().item() < TOL

    # Export (sharded for one family: the index path both ways), then transformers reads it back.
    shard_mb = 0.05 if family == "qwen3" else 5000
    write_hf_dir(
        tmp_path / "out",
        model=model,
        state=model.state_dict(),
        tokenizer=Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json"),
        sources=[tmp_path / "hf"],
        max_shard_mb=shard_mb,
    )
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() == (family == "qwen3")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    # The chat template travels with the export, where transformers 5 writes it.
    expected = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == expected
    assert "chat_template" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_match_each_document_run_alone(family, tmp_path):
    """Rows packing several documents (ids and positions restarting per document) give, document by
    document, transformers' logits of that document run alone."""
    hf = make_hf_dir(family, tmp_path / "hf")
    ids = batch(seq_len=40)
    lengths = [[7, 21, 12], [25, 15]]
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[t for n in row for t in range(n)] for row in lengths])
    with torch.no_grad():
        got = _plait(tmp_path / "hf")(ids, position_ids_bt=positions, document_ids_bt=document_ids)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = hf(ids[b : b + 1, start : start + n]).logits[0]
                assert (got[b, start : start + n] - alone).abs().max().item() < TOL, (b, start)
                start += n


def test_kv_cache_decoding_keeps_gemma3s_windows(tmp_path):
    """Decoding token by token with a KV cache (a prompt of 5, then 1 token at a time, past the
    8-token window) gives transformers' logits of the whole sequence at every position."""
    from trainer.models.kv_cache import kv_cache

    hf = make_hf_dir("gemma3_text", tmp_path / "hf")
    ids = batch(rows=1, seq_len=24)
    model = _plait(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(ids).logits
        steps = []
        with kv_cache(model) as cache:
            for start, end in [(0, 5), *((t, t + 1) for t in range(5, 24))]:
                steps.append(model(ids[:, start:end], position_ids_bt=cache.position_ids(end - start)))
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() < TOL


def test_kv_cache_decoding_keeps_gpt_oss_sinks_and_windows(tmp_path):
    """GPT-OSS decoded token by token with a KV cache (a prompt of 5, then 1 token at a time, past
    the 8-token window): the sinks join every step's softmax; transformers' logits at every position."""
    from trainer.models.kv_cache import kv_cache

    hf = make_hf_dir("gpt_oss", tmp_path / "hf")
    ids = batch(rows=1, seq_len=20)
    model = _plait(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(ids).logits
        steps = []
        with kv_cache(model) as cache:
            for start, end in [(0, 5), *((t, t + 1) for t in range(5, 20))]:
                steps.append(model(ids[:, start:end], position_ids_bt=cache.position_ids(end - start)))
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() < TOL


def test_gpt_oss_refusals_name_the_fix(tmp_path):
    """An MXFP4 (quantized) GPT-OSS checkpoint is refused naming the bf16 copy to make; context
    parallelism is refused for the sinks (its cores have no sink term), naming strategy.cp=1."""
    from trainer.compose import compose

    make_hf_dir("gpt_oss", tmp_path / "hf")
    cp = ["model=hf", f"model.init_from={tmp_path / 'hf'}", "strategy=cp", "trainer.devices=2", "data.seq_len=8"]
    with pytest.raises(ConfigError, match=r"attention sinks .* use strategy.cp=1"):
        validate(compose("pretrain", cp))
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ConfigError, match=r"quantization_config=.*dequantized \(Mxfp4Config\(dequantize=True\)\)"):
        validate(compose("pretrain", ["model=hf", f"model.init_from={tmp_path / 'hf'}"]))
    path.write_text(json.dumps({**config, "layer_types": config["layer_types"][:1]}))  # an edited config
    with pytest.raises(ConfigError, match=r"layer_types has 1 entries for num_hidden_layers=3; give one per layer"):
        validate(compose("pretrain", ["model=hf", f"model.init_from={tmp_path / 'hf'}"]))


def test_an_export_in_another_dtype_says_so_where_transformers_5_reads_it(tmp_path):
    """A source saved by transformers 5 has ``dtype`` in its config.json; a bfloat16 export kept that
    float32 beside a new ``torch_dtype``, and transformers 5 reads ``dtype`` first."""
    make_hf_dir("qwen3", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    model = _plait(tmp_path / "hf")
    write_hf_dir(
        tmp_path / "out",
        model=model,
        state=model.state_dict(),
        tokenizer=Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json"),
        sources=[tmp_path / "hf"],
        dtype="bfloat16",
    )
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").dtype == torch.bfloat16


def test_plait_model_exports_to_transformers(tmp_path):
    """A model plait trained from scratch (QK-norm, own head dim, tied) becomes a Qwen3 directory."""
    from hf_checkpoints import corpus_texts

    from trainer.data.tokenizer import train_bpe

    torch.manual_seed(0)
    model = Llama(
        vocab_size=300,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        qk_norm=True,
        tie_embeddings=True,
        max_seq_len=64,
    ).eval()
    tok = train_bpe(corpus_texts(), vocab_size=300)
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = batch(seq_len=48)
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids)).abs().max().item() < TOL
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "<|endoftext|>"


def test_a_gpt_oss_model_of_plaits_own_without_rope_scaling_exports_its_plain_rope(tmp_path):
    """A GPT-OSS-shaped model trained from scratch with plain RoPE: the export writes rope_parameters
    (rope_type default), else transformers' GptOssConfig would give it YaRN of factor 32."""
    from hf_checkpoints import corpus_texts

    from trainer.data.tokenizer import train_bpe
    from trainer.models.moe_transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64,
        qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=8, window_layers=[0],
        num_experts=4, top_k=2, moe_ffn_dim=32, biases=True, expert_activation="clamped_swiglu",
    ).eval()  # fmt: skip
    with torch.no_grad():  # biases and sinks off their zero init
        for name, p in model.named_parameters():
            if "bias" in name or "sinks" in name:
                p.normal_(0, 0.1)
    tok = train_bpe(corpus_texts(), vocab_size=300)
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    ids = batch(seq_len=48)
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids)).abs().max().item() < TOL


def test_a_gemma3_model_without_a_local_rope_base_exports_its_windows_global_base(tmp_path):
    """Windowed blocks without model.rope_local_theta rotate with the global tables: the export says so
    (sliding_attention's rope_parameters), else transformers would give them its default base 10000."""
    from hf_checkpoints import corpus_texts

    from trainer.data.tokenizer import train_bpe

    torch.manual_seed(0)
    model = Llama(
        vocab_size=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64, tie_embeddings=True,
        qk_norm=True, norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True, activation="gelu_tanh",
        query_pre_attn_scalar=16, sliding_window=8, window_layers=[0, 1], rope_theta=5e5,
    ).eval()  # fmt: skip
    with torch.no_grad():  # every parameter random, the norm weights too
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    tok = train_bpe(corpus_texts(), vocab_size=300)
    write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok, sources=[])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    ids = batch(seq_len=48)
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids)).abs().max().item() < TOL


def _config(tmp_path, *overrides, **edits):
    from hf_checkpoints import write_tokenizer

    from trainer.compose import compose

    make_hf_dir("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(edits)
    path.write_text(json.dumps(config))
    write_tokenizer(tmp_path / "hf")
    return compose("pretrain", ["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=64", *overrides])


@pytest.mark.parametrize(
    "edits, named",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type='dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters.low_freq_factor is required",
        ),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architectures=['GPT2LMHeadModel']"),
        ({"mlp_bias": True}, "mlp_bias=True"),
    ],
)
def test_unsupported_field_fails_in_validate(tmp_path, edits, named):
    cfg = _config(tmp_path, **edits)
    with pytest.raises(ConfigError, match="model.init_from=") as err:
        validate(cfg)
    assert named in str(err.value)


def test_legacy_rope_scaling_layout_is_read(tmp_path):
    """Older config.json files (rope_theta + rope_scaling with ``type``) mean the same tables."""
    hf = make_hf_dir("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    path.write_text(json.dumps(config))
    ids = batch()
    with torch.no_grad():
        assert (_plait(tmp_path / "hf")(ids) - hf(ids).logits).abs().max().item() < TOL


def test_a_rope_scaling_block_pasted_into_a_rope_parameters_config_is_read_and_exported(tmp_path):
    """A transformers 5 config (rope_parameters, default) with a rope_scaling block pasted in, as
    Qwen's YaRN instructions say: transformers applies the block, plait ignored it (logits 1.03
    apart at 64 tokens, a reviewer's), and the export kept both, disagreeing."""
    make_hf_dir("qwen3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    assert "rope_parameters" in config
    config["rope_parameters"]["rope_theta"] = 1e6  # replaced with the block, as transformers 5 reads it
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path.write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = batch()
    model = _plait(tmp_path / "hf")
    assert model.rope_scaling["rope_type"] == "yarn"
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < TOL
        write_hf_dir(
            tmp_path / "out",
            model=model,
            state=model.state_dict(),
            tokenizer=Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json"),
            sources=[tmp_path / "hf"],
        )
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert (again(ids).logits - hf(ids).logits).abs().max().item() < TOL


def test_validate_guides_the_model_choice(tmp_path):
    from trainer.compose import compose

    cfg = _config(tmp_path)
    validate(cfg)  # a supported checkpoint passes
    tiny = compose("pretrain", [f"model.init_from={tmp_path / 'hf'}"])
    with pytest.raises(ConfigError, match="use model=hf model.init_from="):
        validate(tiny)
    window = _config(tmp_path / "w", model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=32)
    with pytest.raises(ConfigError, match="data.seq_len=64 exceeds the checkpoint's context of 32"):
        validate(window)
    # The layout is checked against the checkpoint's heads before any process starts.
    mqa = _config(tmp_path / "mqa", "strategy=tp", "trainer.devices=2", num_key_value_heads=1)
    with pytest.raises(ConfigError, match="strategy.tp=2 does not divide n_heads=4 and n_kv_heads=1"):
        validate(mqa)


def test_a_scaled_rope_on_the_windowed_layers_is_refused_naming_the_field(tmp_path):
    from hf_checkpoints import write_tokenizer

    from trainer.compose import compose

    make_hf_dir("gemma3_text", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    path.write_text(json.dumps(config))
    write_tokenizer(tmp_path / "hf")
    cfg = compose("pretrain", ["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=64"])
    with pytest.raises(ConfigError, match="rope_parameters.sliding_attention.rope_type='linear' is not supported"):
        validate(cfg)


def test_context_parallelism_refuses_windows_shorter_than_the_rows(tmp_path):
    """Gemma 3's 8-token windows: cp's attention cores do not apply them, so cp=2 with 64-token rows
    is refused before launch, naming the fix; rows within the window run."""
    from trainer.compose import compose

    make_hf_dir("gemma3_text", tmp_path / "hf")
    cp = ["model=hf", f"model.init_from={tmp_path / 'hf'}", "strategy=cp", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"model.sliding_window=8 is shorter than data.seq_len=64.*use strategy.cp=1"):
        validate(compose("pretrain", [*cp, "data.seq_len=64"]))
    validate(compose("pretrain", [*cp, "data.seq_len=8"]))


def test_checkpoint_tokenizer_and_chat_template_feed_the_data(tmp_path):
    """With data.tokenizer=null the data module takes the checkpoint's tokenizer and chat template."""
    from hf_checkpoints import CHAT_TEMPLATE

    from trainer.build import build_data
    from trainer.compose import compose

    make_hf_dir("qwen3", tmp_path / "hf")
    cfg = compose(
        "sft",
        [
            "data=synthetic",
            "data.template=auto",
            "data.long_samples=split",
            "model=hf",
            f"model.init_from={tmp_path / 'hf'}",
        ],
    )
    validate(cfg)
    data = build_data(cfg)
    assert data.tokenizer_path == str(tmp_path / "hf" / "tokenizer.json")
    template = data.prepare().template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert template is not None and template.render(messages) == transformers_render(CHAT_TEMPLATE, messages)


def transformers_render(source: str, messages) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=False)


def test_a_tied_checkpoint_under_pp_is_refused_with_a_fix_model_hf_takes(tmp_path):
    # Before: the fix named model.tie_embeddings, which model=hf did not take (unknown key).
    from trainer.compose import compose

    hf = make_hf_dir("llama2", tmp_path / "hf")  # tie_word_embeddings: true
    pp = ["model=hf", f"model.init_from={tmp_path / 'hf'}", "data.seq_len=64", "strategy=pp", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"use model.tie_embeddings=false or strategy.pp=1"):
        validate(compose("pretrain", pp))
    validate(compose("pretrain", [*pp, "model.tie_embeddings=false"]))  # the fix is accepted
    untied = llama_from_hf(str(tmp_path / "hf"), tie_embeddings=False)
    load_init_from(untied, str(tmp_path / "hf"))
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert torch.equal(untied.output.weight, untied.tok_embeddings.weight)  # starts as the tied model
    with torch.no_grad():
        assert (untied.eval()(batch()) - hf(batch()).logits).abs().max().item() < TOL


def test_a_valid_model_hf_config_logs_no_error(tmp_path, caplog):
    """validate of a model=hf config says nothing at ERROR level (Hydra's get_class logged one for the
    factory function llama_from_hf, which a user took for a failure)."""
    from trainer.config import validate

    cfg = _config(tmp_path)
    with caplog.at_level(logging.ERROR):
        validate(cfg)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_tokenizer_from_a_hugging_face_folder_says_nothing_of_the_architecture(tmp_path):
    """plait's own model trained with data.tokenizer=<a Qwen3 folder>/tokenizer.json: the export
    failed ('a llama model cannot be written as its source's qwen3'), and with a Llama folder took
    that model's max_position_embeddings (a reviewer's runs). The folder's tokenizer files are still
    copied; its config.json is not the model's."""
    from harness import compose_config

    from trainer.hf_sources import source_dirs

    make_hf_dir("qwen3", tmp_path / "qwen3")
    cfg = compose_config([f"data.tokenizer={tmp_path / 'qwen3' / 'tokenizer.json'}"])
    assert source_dirs(cfg) == [tmp_path / "qwen3"] and source_dirs(cfg, tokenizer=False) == []
    model = Llama(vocab_size=512, dim=32, n_layers=1, n_heads=2, max_seq_len=96)
    tok = Tokenizer.from_file(tmp_path / "qwen3" / "tokenizer.json")
    out = write_hf_dir(tmp_path / "out", model=model, state=model.state_dict(), tokenizer=tok,
                       sources=source_dirs(cfg), config_sources=source_dirs(cfg, tokenizer=False))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 96
    assert (out / "tokenizer_config.json").read_text() != ""
    # That model's generation settings are not this one's: generate() reads config.json's EOS list.
    assert (tmp_path / "qwen3" / "generation_config.json").is_file() and not (out / "generation_config.json").exists()
