"""Runs that chain through the CLI: ``plait pretrain`` (nano, on one .txt file) -> ``plait sft
model.init_from=<that run>`` -> ``plait dpo model.init_from=<the sft run>`` -> ``plait export``, with
no model override after the first command; ``transformers`` loads the export and generates with
its chat template."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import plait
from omegaconf import OmegaConf

QUIET = [
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.max_steps=3",
    "trainer.enable_progress_bar=false",
    "~callbacks.plots",
]
SFT = [
    "data=synthetic",
    "data.seq_len=64",
    *(
        f"data.sources.{s}.{k}={n}"
        for s in ("reversal", "sorting", "addition")
        for k, n in (("limit", 40), ("val_size", 4))
    ),
]
DPO = ["data=preference_synthetic", "data.sources.copy.limit=40", "data.sources.copy.val_size=8"]


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.slow
def test_pretrain_sft_dpo_export_chain(tmp_path: Path) -> None:
    import torch
    import transformers

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.txt").write_text(
        "".join(f"Verse {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(600))
    )
    pt, sft, dpo, hf = (tmp_path / n for n in ("pt", "sft", "dpo", "hf"))
    _ok(
        plait(
            "pretrain",
            "model=nano",
            "data.seq_len=64",
            f"data.path={corpus}",
            "data.vocab_size=400",
            *QUIET,
            f"run_dir={pt}",
        )
    )
    _ok(plait("sft", *SFT, *QUIET, f"model.init_from={pt}", f"run_dir={sft}"))
    _ok(plait("dpo", *DPO, *QUIET, f"model.init_from={sft}", f"run_dir={dpo}"))
    for run, base in ((sft, pt), (dpo, sft)):  # each run took its base's architecture and tokenizer
        mine, theirs = OmegaConf.load(run / "config.yaml").model, OmegaConf.load(base / "config.yaml").model
        assert mine.init_from == str(base)
        assert {**mine, "init_from": None} == {**theirs, "init_from": None}
        assert (run / "tokenizer.json").read_bytes() == (pt / "tokenizer.json").read_bytes()
    _ok(plait("export", f"ckpt={dpo}", f"out={hf}"))

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "copy: a b c"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
