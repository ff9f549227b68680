"""Prompts of ``plait generate`` and ``plait chat`` are any text: ``prompt=`` is taken as typed
(an apostrophe, a comma, braces: Hydra's override grammar never sees it), ``prompt_file=`` reads a
whole file and ``prompt=-`` stdin; each gives the same greedy continuation of the same text."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_checkpoints import corpus_texts
from omegaconf import OmegaConf

from strategies.checkpoint.dcp import META_FILE, seal
from trainer import chat, generate
from trainer.data.tokenizer import train_bpe
from trainer.rundir import RunDir

MODEL = {"_target_": "trainer.models.llama.Llama", "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2}
PROMPT = "What's 2+2, really? {x} $HOME 'a, b'"
GREEDY = ["max_new_tokens=3", "temperature=0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as training leaves it (one sealed checkpoint, config.yaml, tokenizer.json)."""
    from trainer.models.llama import Llama

    tokenizer = train_bpe(corpus_texts(), vocab_size=300)
    torch.manual_seed(0)
    model = Llama(**{k: v for k, v in MODEL.items() if k != "_target_"}, max_seq_len=128, vocab_size=300)
    run = RunDir(tmp_path_factory.mktemp("gen") / "run")
    dcp.save({"model": model.state_dict()}, checkpoint_id=run.step(1))
    torch.save({}, run.step(1) / META_FILE)
    seal(run.step(1))
    os.symlink(run.step(1).name, run.last)
    OmegaConf.save(OmegaConf.create({"model": {**MODEL, "max_seq_len": 128, "vocab_size": 300}}), run.config)
    tokenizer.save(str(run.tokenizer))
    return run.path


def _stdin(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))


def test_any_prompt_text_from_the_argument_a_file_or_stdin(run_dir, tmp_path, capsys, monkeypatch) -> None:
    generate.main([f"ckpt={run_dir}", f"prompt={PROMPT}", *GREEDY])
    typed = capsys.readouterr().out
    assert typed.startswith(PROMPT) and len(typed.rstrip("\n")) > len(PROMPT)
    (tmp_path / "p.txt").write_text(PROMPT + "\n")
    generate.main([f"ckpt={run_dir}", f"prompt_file={tmp_path / 'p.txt'}", *GREEDY])
    assert capsys.readouterr().out == typed  # the file's final newline is not part of the prompt
    _stdin(monkeypatch, PROMPT + "\n")
    generate.main([*GREEDY, "prompt=-", f"ckpt={run_dir}"])
    assert capsys.readouterr().out == typed
    lines = "def f(x):\n    return x, 'y'"  # a multi-line prompt keeps its lines
    (tmp_path / "code.txt").write_text(lines)
    generate.main([f"ckpt={run_dir}", f"prompt_file={tmp_path / 'code.txt'}", *GREEDY])
    assert capsys.readouterr().out.startswith(lines)


def test_chat_system_message_is_any_text(run_dir, capsys, monkeypatch) -> None:
    _stdin(monkeypatch, "hi, you\n")
    chat.main([f"ckpt={run_dir}", "system=You're terse, and exact: {no} 'sweep'", *GREEDY])
    out = capsys.readouterr()
    assert len(out.out.splitlines()) >= 1 and "error" not in out.err


def test_chat_skips_empty_lines(run_dir, capsys, monkeypatch) -> None:
    """An empty stdin line is no user turn (it was answered as one); the lines around it are."""
    _stdin(monkeypatch, "hi\n\n   \nhow are you\n")
    chat.main([f"ckpt={run_dir}", *GREEDY])
    answers = capsys.readouterr().out.split("\n")[:-1]
    _stdin(monkeypatch, "hi\nhow are you\n")
    chat.main([f"ckpt={run_dir}", *GREEDY])
    assert answers == capsys.readouterr().out.split("\n")[:-1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["prompt=a", "prompt_file=b.txt"], "prompt= and prompt_file= are both given"),
        (["prompt_file=no/such.txt"], "prompt_file=no/such.txt: No such file"),
        (["prompt=a", "prompt=b"], "prompt= is given twice"),
    ],
)
def test_bad_prompt_arguments_name_the_fix(args, says, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        generate.main(["ckpt=no_such_run", *args])
    assert exited.value.code == 2 and says in capsys.readouterr().err
