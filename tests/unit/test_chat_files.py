"""A Hugging Face directory's chat template is read wherever transformers reads it (transformers 5's
``save_pretrained`` writes ``chat_template.jinja``, not ``tokenizer_config.json``), the data renders
with it, the launch line names it, a run records it and an export writes it where transformers 5
reads it. The reference is transformers itself: its ``from_pretrained`` picks the template, its
``apply_chat_template`` gives the ids and the assistant mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import CONVERSATIONS, LLAMA3_STYLE, QWEN3_STYLE, raw_tokenizer

from trainer.data.base import DataError
from trainer.data.chat import ChatError, load_chat_template
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer

transformers = pytest.importorskip(
    "transformers", reason="transformers (the dev extra) is the reference for chat templates"
)


def save_pretrained(directory: Path, template: str | None) -> Path:
    """A tokenizer directory as transformers writes it (``chat_template.jinja`` beside ``tokenizer.json``)."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer(),
        eos_token="<|endoftext|>",
        bos_token="<|begin_of_text|>",
        chat_template=template,
    )
    hf.save_pretrained(directory)
    return directory


def _sft_data(tmp_path: Path, *overrides: str):
    from trainer.build import build_data
    from trainer.compose import compose

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    source = "{mine: {source: '%s', val_size: 2}}" % chats
    cfg = compose(
        "sft",
        [f"data.sources={source}", f"data.cache_dir={tmp_path / 'cache'}", "train.global_batch_size=2", *overrides],
    )
    return build_data(cfg)


def test_sft_data_renders_with_the_template_transformers_5_saved(tmp_path: Path) -> None:
    hf_dir = save_pretrained(tmp_path / "tok", QWEN3_STYLE)
    assert (hf_dir / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((hf_dir / "tokenizer_config.json").read_text())  # transformers 5's layout

    data = _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}")
    prepared = data.prepare()
    assert (
        data.chat_format().line()
        == f"chat template: {hf_dir / 'chat_template.jinja'} (supervised: its {{% generation %}} blocks)"
    )

    # Every sample is one conversation as transformers tokenizes and masks it.
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    expected = set()
    for messages in CONVERSATIONS:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        expected.add(
            (
                tuple(ids),
                tuple([ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]),
            )
        )
    samples = [split["mine"].sample(i) for split in (prepared.train, prepared.val) for i in range(len(split["mine"]))]
    # the file repeats each conversation 4 times: copies of a held-out one are left out of training
    assert len(CONVERSATIONS) <= len(samples) <= 4 * len(CONVERSATIONS)
    assert {(tuple(ids.tolist()), tuple(labels.tolist())) for ids, labels in samples} == expected


def test_without_a_template_the_launch_line_says_default_and_why(tmp_path: Path) -> None:
    hf_dir = save_pretrained(tmp_path / "tok", None)
    assert not list(hf_dir.glob("*.jinja"))
    auto = _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}")
    assert auto.chat_format().template is None
    line = auto.chat_format().line()
    assert line.startswith("chat template: plait's default (<|user|> / <|assistant|> lines") and str(hf_dir) in line
    # data.template=tokenizer asks for one: refused, naming where it looked and the fix.
    with pytest.raises(
        DataError,
        match=r"data.template=tokenizer but there is no chat template beside .*chat_template.jinja.*data.template=auto or default",
    ):
        _sft_data(tmp_path, f"data.tokenizer={hf_dir / 'tokenizer.json'}", "data.template=tokenizer").prepare()
    chosen = _sft_data(
        tmp_path,
        f"data.tokenizer={save_pretrained(tmp_path / 'own', LLAMA3_STYLE) / 'tokenizer.json'}",
        "data.template=default",
    )
    assert chosen.chat_format().line().endswith("(data.template=default)")


def _layouts(directory: Path) -> dict[str, Path]:
    """Tokenizer directories laid out as transformers 4 and 5 and hub repositories write them."""
    one, two = QWEN3_STYLE, LLAMA3_STYLE
    config = json.loads((save_pretrained(directory / "base", None) / "tokenizer_config.json").read_text())
    layouts = {
        "jinja_over_config": ({"chat_template.jinja": one}, {"chat_template": two}),
        "config_only": ({}, {"chat_template": two}),
        "config_named_list": (
            {},
            {"chat_template": [{"name": "tool_use", "template": one}, {"name": "default", "template": two}]},
        ),
        "named_files_over_config": (
            {"additional_chat_templates/default.jinja": one, "additional_chat_templates/rag.jinja": two},
            {"chat_template": two},
        ),
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
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": QWEN3_STYLE, "eos_token": "<|endoftext|>"})
    )
    with pytest.raises(ValueError):
        transformers.AutoTokenizer.from_pretrained(directory).get_chat_template()
    tok = Tokenizer.from_file(directory / "tokenizer.json")
    with pytest.raises(ChatError, match=r"named \['rag'\] but none named 'default'"):
        load_chat_template(str(directory / "tokenizer.json"), tok)


def test_an_export_writes_the_trained_template_where_transformers_5_reads_it(tmp_path: Path) -> None:
    from hf_checkpoints import make_hf_dir

    from trainer.export import write_hf_dir
    from trainer.init_from import load_init_from
    from trainer.models.hf import llama_from_hf

    make_hf_dir("qwen3", tmp_path / "hf")  # its tokenizer_config.json holds another template (transformers 4's layout)
    model = llama_from_hf(str(tmp_path / "hf"))
    load_init_from(model, str(tmp_path / "hf"))
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    for template, out in ((QWEN3_STYLE, tmp_path / "trained"), (None, tmp_path / "source")):
        write_hf_dir(
            out, model=model, state=model.state_dict(), tokenizer=tok, sources=[tmp_path / "hf"], chat_template=template
        )
        assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
        expected = template or json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
        assert transformers.AutoTokenizer.from_pretrained(out).chat_template == expected


def _run(tmp_path: Path, *, recorded: str | None | bool, template: str = "auto"):
    """A run (as `trainer.export.trained_chat_template` sees it) whose data took its tokenizer from a
    transformers 5 directory holding LLAMA3_STYLE; ``recorded``: the template the run recorded at
    launch (None: plait's default), False: a run from before the record."""
    from omegaconf import OmegaConf

    from trainer.run_model import RunModel
    from trainer.rundir import RunDir

    source = save_pretrained(tmp_path / "tok", LLAMA3_STYLE)
    tok = Tokenizer.from_file(source / "tokenizer.json")
    cfg = OmegaConf.create(
        {"model": {"init_from": None}, "data": {"tokenizer": str(source / "tokenizer.json"), "template": template}}
    )
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    if recorded is False:
        tok.save(run.tokenizer)
    else:
        run.write_config(cfg, tok, special_tokens={"bos_token": "<|begin_of_text|>"}, chat_template=recorded)
    return RunModel(model=None, tokenizer=tok, config=cfg, run=run, checkpoint=None)


def test_a_run_records_the_template_it_trained_with_and_exports_that(tmp_path: Path) -> None:
    from trainer.data.chat import DEFAULT_CHAT_TEMPLATE
    from trainer.export import trained_chat_template

    run = _run(tmp_path / "own", recorded=QWEN3_STYLE)
    template = trained_chat_template(run)
    assert (template.source, template.origin) == (QWEN3_STYLE, str(run.run.chat_template))
    assert template.special["bos_token"] == "<|begin_of_text|>"  # the tokens it rendered with travel too
    # Recorded default: the data rendered with plait's, whatever its tokenizer's directory holds.
    assert trained_chat_template(_run(tmp_path / "default", recorded=None)).source == DEFAULT_CHAT_TEMPLATE
    # A run from before the record: where its data found it (transformers 5's file), unless it chose the default.
    assert trained_chat_template(_run(tmp_path / "old", recorded=False)).source == LLAMA3_STYLE
    assert (
        trained_chat_template(_run(tmp_path / "old_default", recorded=False, template="default")).source
        == DEFAULT_CHAT_TEMPLATE
    )


def test_a_run_tokenizer_without_plaits_eos_reads_back(tmp_path: Path) -> None:
    """A Llama 3-like vocabulary has no <|endoftext|>: its EOS was named by the source's
    tokenizer_config.json, so the run writes one beside its tokenizer.json (before, reading the
    run's tokenizer back, as export and generate do, failed: EOS not in the vocabulary)."""
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from trainer.rundir import RunDir

    raw = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    raw.add_special_tokens(["<|end_of_text|>", "<|finetune_right_pad_id|>"])
    tok = Tokenizer(raw, eos_token="<|end_of_text|>", pad_token="<|finetune_right_pad_id|>")
    run = RunDir(tmp_path)
    run.write_config(OmegaConf.create({"data": {}}), tok)
    back = Tokenizer.from_file(run.tokenizer)
    assert (back.eos_token, back.eos_id, back.pad_id) == ("<|end_of_text|>", tok.eos_id, tok.pad_id)
