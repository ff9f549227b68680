"""A Hugging Face directory's chat template is read wherever transformers reads it (transformers 5's
``save_pretrained`` writes ``chat_template.jinja``, not ``tokenizer_config.json``), the data renders
with it and the launch line names it. The reference is transformers itself: its ``from_pretrained``
picks the template, its ``apply_chat_template`` gives the ids and the assistant mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import CONVERSATIONS, LLAMA3_STYLE, QWEN3_STYLE, raw_tokenizer

from trainer.data.base import DataError
from trainer.data.chat import ChatError, load_chat_template
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is the reference for chat templates")


def save_pretrained(directory: Path, template: str | None) -> Path:
    """A tokenizer directory as transformers writes it (``chat_template.jinja`` beside ``tokenizer.json``)."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer(), eos_token="<|endoftext|>", bos_token="<|begin_of_text|>", chat_template=template
    )
    hf.save_pretrained(directory)
    return directory


def _sft_data(tmp_path: Path, *overrides: str):
    from trainer.build import build_data
    from trainer.compose import compose

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    source = "{mine: {source: '%s', val_size: 2}}" % chats
    cfg = compose("sft", [f"data.sources={source}", f"data.cache_dir={tmp_path / 'cache'}", "train.global_batch_size=2", *overrides])
    return build_data(cfg)


def test_sft_data_renders_with_the_template_transformers_5_saved(tmp_path: Path) -> None:
    hf_dir = save_pretrained(tmp_path / "tok", QWEN3_STYLE)
    assert (hf_dir / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((hf_dir / "tokenizer_config.json").read_text())  # transformers 5's layout

    data = _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}")
    prepared = data.prepare()
    assert data.chat_format().line() == f"chat template: {hf_dir / 'chat_template.jinja'} (supervised: its {{% generation %}} blocks)"

    # Every sample is one conversation as transformers tokenizes and masks it.
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    expected = set()
    for messages in CONVERSATIONS:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        expected.add((tuple(ids), tuple([ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX])))
    samples = [split["mine"].sample(i) for split in (prepared.train, prepared.val) for i in range(len(split["mine"]))]
    assert len(samples) == 4 * len(CONVERSATIONS)
    assert {(tuple(ids.tolist()), tuple(labels.tolist())) for ids, labels in samples} == expected


def test_without_a_template_the_launch_line_says_default_and_why(tmp_path: Path) -> None:
    hf_dir = save_pretrained(tmp_path / "tok", None)
    assert not list(hf_dir.glob("*.jinja"))
    auto = _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}")
    assert auto.chat_format().template is None
    line = auto.chat_format().line()
    assert line.startswith("chat template: plait's default (<|user|> / <|assistant|> lines") and str(hf_dir) in line
    # data.template=tokenizer asks for one: refused, naming where it looked and the fix.
    with pytest.raises(DataError, match=r"data.template=tokenizer but there is no chat template beside .*chat_template.jinja.*data.template=auto or default"):
        _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}", "data.template=tokenizer").prepare()
    chosen = _sft_data(tmp_path, f"data.tokenizer={save_pretrained(tmp_path / 'own', LLAMA3_STYLE) / 'tokenizer.json'}", "data.template=default")
    assert chosen.chat_format().line().endswith("(data.template=default)")


def _layouts(directory: Path) -> dict[str, Path]:
    """Tokenizer directories laid out as transformers 4 and 5 and hub repositories write them."""
    one, two = QWEN3_STYLE, LLAMA3_STYLE
    config = json.loads((save_pretrained(directory / "base", None) / "tokenizer_config.json").read_text())
    layouts = {
        "jinja_over_config": ({"chat_template.jinja": one}, {"chat_template": two}),
        "config_only": ({}, {"chat_template": two}),
        "config_named_list": ({}, {"chat_template": [{"name": "tool_use", "template": one}, {"name": "default", "template": two}]}),
        "named_files_over_config": ({"additional_chat_templates/default.jinja": one, "additional_chat_templates/rag.jinja": two}, {"chat_template": two}),
        "jinja_and_named_files": ({"chat_template.jinja": two, "additional_chat_templates/tool_use.jinja": one}, {}),
    }
    out = {}
    for name, (files, entries) in layouts.items():
        target = directory / name
        (target / "additional_chat_templates").mkdir(parents=True)
        (target / "tokenizer.json").write_bytes((directory / "base" / "tokenizer.json").read_bytes())
        (target / "tokenizer_config.json").write_text(json.dumps({**config, **entries}))
        for file, text in files.items():
            (target / file).write_text(text)
        out[name] = target
    return out


def test_the_template_is_the_one_transformers_loads(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(save_pretrained(tmp_path / "base", None) / "tokenizer.json")
    for name, directory in _layouts(tmp_path).items():
        reference = transformers.AutoTokenizer.from_pretrained(directory).get_chat_template()
        found = load_chat_template(str(directory / "tokenizer.json"), tok)
        assert found is not None and found.source == reference, name


def test_named_templates_without_a_default_are_refused_as_transformers_refuses_them(tmp_path: Path) -> None:
    directory = save_pretrained(tmp_path / "tok", None)
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "rag.jinja").write_text(LLAMA3_STYLE)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_STYLE, "eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError):
        transformers.AutoTokenizer.from_pretrained(directory).get_chat_template()
    tok = Tokenizer.from_file(directory / "tokenizer.json")
    with pytest.raises(ChatError, match=r"named \['rag'\] but none named 'default'"):
        load_chat_template(str(directory / "tokenizer.json"), tok)

