"""Qwen3-MoE and Mixtral checkpoints made by ``transformers`` (tests/hf_checkpoints.py): the plait
model is a mixture of experts of the checkpoint's shape, and its export reloads bit for bit.

(The logits against transformers' within 1e-5 and transformers' reload of the export are checked
for every family in tests/unit/test_hf.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_checkpoints import batch, make_hf_dir

from trainer.data.tokenizer import Tokenizer
from trainer.export import write_hf_dir
from trainer.init_from import load_init_from
from trainer.models.hf import HFError, llama_from_hf
from trainer.models.moe_transformer import MoETransformer


def _load(directory, **router):
    model = llama_from_hf(str(directory), **router)
    load_init_from(model, str(directory))
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_export_round_trips_bit_exactly(family, tmp_path):
    make_hf_dir(family, tmp_path / "hf")
    model = _load(tmp_path / "hf")
    assert isinstance(model, MoETransformer)
    assert (model.num_experts, model.top_k, model.n_dense_layers) == (4, 2, 1 if family == "qwen3_moe" else 0)
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
