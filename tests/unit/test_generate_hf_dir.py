"""``plait generate``/``chat`` ``ckpt=<Hugging Face directory>``: the directory's model, weights and
tokenizer (`trainer.run_model.load_hf_model`), equal to transformers' own model of it."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import make_hf_dir

from trainer.generate import main as generate
from trainer.run_model import load_run_model


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hub") / "llama"
    return directory, make_hf_dir("llama3", directory)


def test_the_directory_loads_as_transformers_builds_it(hub) -> None:
    directory, reference = hub
    run = load_run_model(directory)
    ids = torch.randint(0, run.tokenizer.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(run.model(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_generate_reads_the_directory(hub, capsys) -> None:
    """Greedy decoding through the command equals transformers' greedy ``generate``."""
    directory, reference = hub
    run = load_run_model(directory)
    prompt = "hello world"
    ids = torch.tensor([run.tokenizer.encode(prompt)])
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = prompt + run.tokenizer.decode(out[0, ids.shape[1] :].tolist())
    generate([f"ckpt={directory}", f"prompt={prompt}", "max_new_tokens=6", "temperature=0"])
    captured = capsys.readouterr()
    assert f"plait: loaded {directory}" in captured.err
    assert captured.out.rstrip("\n") == expected


def test_a_run_whose_hub_folder_moved_is_one_error_naming_it(tmp_path) -> None:
    """A run of a Hugging Face model builds from that folder (model.config_from / init_from): once it
    has moved, generate/export/merge say so in one line, not a Hydra traceback."""
    from omegaconf import OmegaConf

    from trainer.models.hf import HFError
    from trainer.run_model import HF_BUILDER, instantiate_saved

    node = OmegaConf.create({"_target_": HF_BUILDER, "init_from": "runs/sft", "config_from": str(tmp_path / "gone")})
    with pytest.raises(HFError) as err:
        instantiate_saved(node, source="runs/dpo/config.yaml", key="model", vocab_size=8)
    assert str(err.value).startswith(
        "runs/dpo/config.yaml (model) builds from a Hugging Face directory that cannot be read"
    )
    assert "set its new path in that config.yaml (model.config_from, or model.init_from)" in str(err.value)


def test_a_context_that_stops_generation_first_is_said() -> None:
    """plait generate on a Mistral whose 16-token window caps its context stopped after 5 new tokens,
    printing nothing. `trainer.sampling.sample` keeps the prompt's last context - 1 tokens."""
    from trainer.generate import context_line

    assert context_line(11, 5, 16) is None
    assert "at most 5 new tokens" in context_line(11, 30, 16) and "window" in context_line(11, 30, 16)
    assert "at most 1 new tokens; its first 5 prompt tokens are dropped" in context_line(20, 4, 16)
