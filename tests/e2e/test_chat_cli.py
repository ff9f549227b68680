"""The SFT -> chat path through the CLI: ``plait chat`` and ``plait generate chat=true`` answer with
the run's chat template and say which checkpoint they loaded; ``plait export`` writes that template,
so ``transformers`` renders the same prompt with ``apply_chat_template`` and generates from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness import CLI_TINY, plait

from trainer.data.chat import prompt_text

SFT = [
    *(o for o in CLI_TINY if not o.startswith("data.eval_rows=")), "data=synthetic", "data.sources.reversal.limit=40", "data.sources.sorting.limit=40",
    "data.sources.addition.limit=40", "data.sources.reversal.val_size=4", "data.sources.sorting.val_size=4",
    "data.sources.addition.val_size=4",
]  # fmt: skip


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("chat") / "sft"
    _ok(plait("sft", *SFT, f"run_dir={run_dir}"))
    return run_dir


@pytest.mark.slow
def test_chat_and_generate_answer_with_the_template(sft_run: Path) -> None:
    chat = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "chat", f"ckpt={sft_run}", "max_new_tokens=8", "temperature=0"],
        input="reverse abc\nsort 3 1 2\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    _ok(chat)
    assert "plait: loaded" in chat.stderr and "step_" in chat.stderr
    assert len(chat.stdout.splitlines()) >= 2, chat.stdout  # one answer per line read (answers may hold newlines)
    generated = _ok(
        plait("generate", f"ckpt={sft_run}", "prompt=reverse abc", "chat=true", "max_new_tokens=8", "temperature=0")
    )
    assert "plait: loaded" in generated.stderr


@pytest.mark.slow
def test_export_renders_the_chat_template_in_transformers(sft_run: Path, tmp_path: Path) -> None:
    import torch
    import transformers

    _ok(plait("export", f"ckpt={sft_run}", f"out={tmp_path / 'hf'}"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "reverse abc"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == prompt_text(messages)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, : ids.shape[1]], ids[0])
