"""Hugging Face config fields plait reads as transformers does where a config is silent or a family
differs: Mixtral's sliding window, and each family's default for a missing tie_word_embeddings
(the families' logits and round trips: tests/unit/test_hf.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_checkpoints import batch, make_hf_dir

from trainer.init_from import load_init_from
from trainer.models.hf import llama_from_hf
from trainer.models.llama import Llama

TOL = 1e-5


def _plait(directory) -> Llama:
    model = llama_from_hf(str(directory))
    load_init_from(model, str(directory))
    return model.eval()


def test_a_mixtral_window_caps_the_context_as_mistrals_does(tmp_path):
    """transformers' Mixtral applies any sliding_window its config sets; plait ignored it (logits 1.66 apart
    on 32-token rows under an 8-token window). Mutation: Mixtral's family without windowed=True."""
    hf = make_hf_dir("mixtral", tmp_path / "hf", sliding_window=8)
    model = _plait(tmp_path / "hf")
    assert model.max_seq_len == 8
    with torch.no_grad():
        assert (model(batch(seq_len=8)) - hf(batch(seq_len=8)).logits).abs().max().item() < TOL
        with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
            model(batch(seq_len=32))


@pytest.mark.parametrize("family", ["gemma3_text", "smollm3"])
def test_a_config_without_tie_word_embeddings_takes_the_familys_default(family, tmp_path):
    """google/gemma-3-1b-it's config.json has no tie_word_embeddings: transformers ties (Gemma3TextConfig's
    default), plait untied the head and trained it apart from the embedding. Mutation: defaulting to False."""
    hf = make_hf_dir(family, tmp_path / "hf", tie_word_embeddings=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["tie_word_embeddings"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    model = _plait(tmp_path / "hf")
    assert model.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        assert (model(batch()) - hf(batch()).logits).abs().max().item() < TOL
