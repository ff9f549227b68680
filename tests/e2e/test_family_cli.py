"""The OLMo 2, SmolLM3, Gemma 3, DeepSeek-V3 and GPT-OSS families from the command line, in real subprocesses: ``plait pretrain``
of each tiny preset, whose export transformers reads as the family's class with plait's logits; and
``plait sft model=hf`` from a checkpoint transformers wrote (tests/hf_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import CLI_TINY, plait, train_rows

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) writes and reads the directories"
)

# preset -> (its transformers class, overrides). SmolLM3's NoPE layer moved off transformers' default
# (every fourth, the preset's), so the export must write no_rope_layers for the logits to agree.
PRESETS = {
    "olmo2_tiny": ("Olmo2ForCausalLM", ()),
    "smollm3_tiny": ("SmolLM3ForCausalLM", ("model.nope_layers=[1]",)),
    # windows of 16 in the 64-token rows, and in the 48-token logits compared
    "gemma3_tiny": ("Gemma3ForCausalLM", ("model.n_layers=3", "model.window_layers=[0,2]", "model.sliding_window=16")),
    # 4 steps move the auxiliary-loss-free expert biases off zero: the export writes them
    "deepseek_v3_tiny": ("DeepseekV3ForCausalLM", ("model.n_kv_heads=4",)),
    # windows of 16 in the 64-token rows and the 48-token logits; sinks and biases trained 4 steps
    "gpt_oss_tiny": ("GptOssForCausalLM", ("model.sliding_window=16",)),
}
SMALL = ("model.dim=64", "model.n_heads=4", "model.max_seq_len=64")
SFT = (
    "data=synthetic",
    "data.template=auto",
    "data.seq_len=64",
    "data.long_samples=split",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.max_steps=2",
    "trainer.enable_progress_bar=false",
    "~callbacks.plots",
    *(
        f"data.sources.{s}.{k}={n}"
        for s in ("reversal", "sorting", "addition")
        for k, n in (("limit", 12), ("val_size", 2))
    ),
)


def _ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.mark.slow  # ~20 s each: a 4-step run and an export
@pytest.mark.parametrize("preset", list(PRESETS))
def test_pretrain_a_family_preset_and_export_it(tmp_path: Path, preset: str) -> None:
    from trainer.run_model import load_run_model

    run, out = tmp_path / "run", tmp_path / "export"
    architecture, overrides = PRESETS[preset]
    _ok(plait("pretrain", *CLI_TINY, f"model={preset}", *SMALL, *overrides, f"run_dir={run}"))
    assert max(train_rows(run)) == 4
    _ok(plait("export", f"ckpt={run}", f"out={out}"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == architecture
    model = load_run_model(run).model.eval()
    ids = torch.randint(0, model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-5
    if preset == "deepseek_v3_tiny":  # the routing biases the 4 steps moved, written and read back
        bias = model.layers["1"].feed_forward.router.expert_bias
        assert bias.abs().max() > 0 and torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)


@pytest.mark.slow  # ~15 s each: a 2-step SFT run
@pytest.mark.parametrize("family", ["olmo2", "smollm3", "gemma3_text", "deepseek_v3", "gpt_oss"])
def test_sft_from_a_family_checkpoint(tmp_path: Path, family: str) -> None:
    from hf_checkpoints import make_hf_dir

    make_hf_dir(family, tmp_path / "hf")
    run = tmp_path / "run"
    _ok(plait("sft", "model=hf", f"model.init_from={tmp_path / 'hf'}", *SFT, f"run_dir={run}"))
    rows = train_rows(run)
    assert max(rows) == 2 and torch.isfinite(torch.tensor(float(rows[2]["train/loss"])))
