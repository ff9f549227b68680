"""The exported PEFT adapter adapts exactly the layers plait adapted, checked by ``peft`` itself.

For each case, plait loads a random Hugging Face checkpoint (`hf_checkpoints.make_hf_dir`, written
by ``transformers``), adds adapters with a ``strategy.lora.target_modules`` list and random A and B,
and writes them with `trainer.export.write_peft_adapter`. ``peft.PeftModel.from_pretrained`` then
loads the adapter onto the checkpoint as transformers reads it. The reference: the modules peft
wraps equal the layers plait adapted, renamed by this file's own table of Hugging Face names; and
peft's logits equal plait's forward with its adapters (fp32).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_checkpoints import batch, make_hf_dir, transformers

from strategies.transforms.lora import DEFAULT_TARGETS, apply_lora
from trainer.export import write_peft_adapter
from trainer.init_from import load_init_from
from trainer.models.hf import llama_from_hf

peft = pytest.importorskip("peft", reason="peft (the dev extra) is the reference for the adapter format")

TOL = {"rtol": 1e-5, "atol": 1e-5}
# plait module -> Hugging Face module, written here (not trainer.models.hf's table).
_IN_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "feed_forward.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "feed_forward.shared_experts.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared_experts.w2": "mlp.shared_experts.down_proj",
}  # fmt: skip
# checkpoint -> (hf_checkpoints family, config overrides, config.json model_type: the family plait exports as)
CHECKPOINTS = {
    "llama3": ("llama3", {}, "llama"),
    "llama3_deep": ("llama3", {"num_hidden_layers": 4}, "llama"),
    "qwen3_moe": ("qwen3_moe", {}, "qwen3_moe"),
    "mixtral": ("mixtral", {}, "mixtral"),
    "deepseek_v3": ("deepseek_v3", {}, "deepseek_v3"),
}
# (checkpoint, target_modules, number of adapted layers counted by hand; 2 blocks unless "deep")
CASES = {
    "default": ("llama3", list(DEFAULT_TARGETS), 14),
    "layer_glob": ("llama3", ["layers.0.*"], 7),
    "mixed": ("llama3", ["wq", "layers.1.feed_forward.w2", "layers.0.attention.w[kv]", "output"], 6),
    # 21 full names: peft rewrites a list of 20 or more into suffixes of its own (MIN_TARGET_MODULES_FOR_OPTIMIZATION)
    "many_full_names": ("llama3_deep", ["layers.[0-2].*"], 21),
    "moe_attention": ("mixtral", ["wq", "wk", "wv", "wo"], 8),
    "moe_every_router": ("mixtral", ["layers.0.attention.wq", "gate"], 3),
}


def _hf_module(fqn: str) -> str:
    if fqn == "output":
        return "lm_head"
    layer, inner = re.fullmatch(r"layers\.(\d+)\.(.+)", fqn).groups()
    return f"model.layers.{layer}.{'mlp.gate' if inner == 'feed_forward.router.gate' else _IN_LAYER[inner]}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_export")
    for name, (family, overrides, _) in CHECKPOINTS.items():
        make_hf_dir(family, root / name, **overrides)
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapts_exactly_what_plait_adapted(checkpoints, tmp_path, case):
    checkpoint, targets, count = CASES[case]
    model = llama_from_hf(str(checkpoints / checkpoint))
    load_init_from(model, str(checkpoints / checkpoint))
    names = apply_lora(model, rank=4, alpha=8.0, target_modules=targets)
    assert len(names) == count, names
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in names:  # both random, so every adapter changes the logits
            for adapter in (model.get_submodule(name).lora_A, model.get_submodule(name).lora_B):
                adapter.weight.copy_(0.1 * torch.randn(adapter.weight.shape, generator=generator))
    write_peft_adapter(tmp_path / "adapter", model, dropout=0.0, base=None, family=CHECKPOINTS[checkpoint][2])

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / checkpoint, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(hf_base.eval(), tmp_path / "adapter").eval()
    wrapped = {
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    assert wrapped == {_hf_module(n) for n in names}, "peft adapts exactly plait's adapted layers"
    ids = batch(seq_len=24)
    with torch.no_grad():
        expected = model.eval()(ids)
        torch.testing.assert_close(peft_model(ids).logits, expected, **TOL, msg="peft's forward with the adapter")


def test_a_kind_adapted_in_every_layer_keeps_its_short_name(checkpoints, tmp_path):
    """The common case reads as PEFT users write it; a partial kind is named in full."""
    model = llama_from_hf(str(checkpoints / "llama3"))
    apply_lora(model, rank=4, alpha=8.0, target_modules=["wq", "wo", "layers.1.feed_forward.w2"])
    write_peft_adapter(tmp_path, model, dropout=0.0, base=None, family="llama")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.1.mlp.down_proj", "o_proj", "q_proj"]


@pytest.mark.parametrize(
    ("family", "targets", "named"),
    [
        # Block 0 is dense: peft (transformers >= 5) would put its MLP adapters on block 1's experts.
        ("qwen3_moe", list(DEFAULT_TARGETS), "would load onto the experts"),
        # DeepSeek-V3 alike: the dense block 0 and the shared experts (the MLP targets its docs give)
        ("deepseek_v3", ["w1", "w2", "w3"], "would load onto the experts"),
        # A router in one block of two: peft would adapt both.
        ("mixtral", ["layers.1.*"], "adapts every block's router"),
    ],
)
def test_an_adapter_peft_would_load_elsewhere_is_refused(checkpoints, tmp_path, family, targets, named):
    """The premise, checked with peft: even the adapted modules' full names make it wrap others."""
    from trainer.models.hf import HFError

    model = llama_from_hf(str(checkpoints / family))
    names = apply_lora(model, rank=4, alpha=8.0, target_modules=targets)
    with pytest.raises(HFError, match=named) as err:
        write_peft_adapter(tmp_path / "adapter", model, dropout=0.0, base=None, family=family)
    assert "adapter=false" in str(err.value) and not (tmp_path / "adapter").exists()

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / family)
    full_names = sorted(_hf_module(n) for n in names)
    peft_model = peft.get_peft_model(hf_base, peft.LoraConfig(r=4, target_modules=full_names))
    wrapped = {
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    assert wrapped != set(full_names), "peft adapts these names as written now: the refusal can go"


def test_a_gpt_oss_router_adapter_is_refused_as_peft_cannot_load_it(tmp_path):
    """The export wrote target_modules [q_proj, router], which peft refuses ('Target module
    GptOssTopKRouter() is not supported', a reviewer's run); the merged export stays exact."""
    from trainer.models.hf import HFError

    make_hf_dir("gpt_oss", tmp_path / "hf")
    model = llama_from_hf(str(tmp_path / "hf"))
    apply_lora(model, rank=4, alpha=8.0, target_modules=["wq", "gate"])
    with pytest.raises(HFError, match="peft cannot adapt a gpt_oss model's router") as err:
        write_peft_adapter(tmp_path / "adapter", model, dropout=0.0, base=None, family="gpt_oss")
    assert "adapter=false" in str(err.value) and not (tmp_path / "adapter").exists()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="not supported"):  # the premise, checked with peft
        peft.get_peft_model(hf_base, peft.LoraConfig(r=4, target_modules=["router"]))


def test_an_adapter_trained_on_a_plait_run_names_no_base_transformers_cannot_load(checkpoints, tmp_path, capsys):
    """It named the plait checkpoint, and peft's AutoPeftModelForCausalLM failed on it ('Unrecognized
    model ... Should have a model_type key', a reviewer's chain of SFT then LoRA)."""
    from trainer.export import peft_base

    assert peft_base(str(checkpoints / "llama3")) == str(checkpoints / "llama3")
    (tmp_path / "sft").mkdir()
    assert peft_base(str(tmp_path / "sft")) is None
    assert f"export that run (plait export ckpt={tmp_path / 'sft'} out=<dir>)" in capsys.readouterr().err
