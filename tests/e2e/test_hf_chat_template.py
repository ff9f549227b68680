"""Fine-tuning a Hugging Face model whose tokenizer transformers 5 saved (the chat template in
``chat_template.jinja``, not in ``tokenizer_config.json``): ``plait sft model=hf model.init_from=<dir>``
says at launch that it renders with that file, the run records it, and ``plait export`` writes it
where transformers reads it (before: plait's default template, silently, in the data and the export)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import plait

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) saves and reads the directories"
)

# ChatML whose assistant turns are {% generation %} blocks (TRL's training templates mark them so).
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUIET = [
    "data=synthetic",
    "data.template=auto",
    "data.seq_len=128",
    "data.long_samples=split",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.max_steps=2",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "~callbacks.plots",
    *(
        f"data.sources.{s}.{k}={n}"
        for s in ("reversal", "sorting", "addition")
        for k, n in (("limit", 12), ("val_size", 2))
    ),
]


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.slow  # ~25 s of CPU: an SFT run and an export
def test_sft_of_a_transformers_5_directory_trains_and_exports_its_template(tmp_path: Path) -> None:
    from hf_checkpoints import make_hf_dir

    hf_dir = tmp_path / "hf"
    make_hf_dir("qwen3", hf_dir)
    (hf_dir / "tokenizer_config.json").unlink()  # re-saved by transformers 5 below, with its template
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="<|endoftext|>", chat_template=TEMPLATE
    ).save_pretrained(hf_dir)
    assert "chat_template" not in json.loads((hf_dir / "tokenizer_config.json").read_text())

    run = tmp_path / "run"
    result = _ok(plait("sft", "model=hf", f"model.init_from={hf_dir}", *QUIET, f"run_dir={run}"))
    assert (
        f"plait: chat template: {hf_dir / 'chat_template.jinja'} (supervised: its {{% generation %}} blocks)"
        in result.stderr
    )
    assert (run / "chat_template.jinja").read_text() == TEMPLATE

    _ok(plait("export", f"ckpt={run}", f"out={tmp_path / 'export'}"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.chat_template == TEMPLATE
    assert "chat_template" not in json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
