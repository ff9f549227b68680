"""What data preparation cuts is counted per source, warned about, and refused when nothing is left.

The counts are checked against the rows the data modules hand to training (read back here: the
prompt tokens a pair row holds, the supervised labels of the kept samples), not against the
rule that produced them. The 83bde6a preset (``data=preference_synthetic`` at seq_len 32,
max_prompt_len 16) cut the letters out of every copy prompt without a word; it now warns.
"""

from __future__ import annotations

import json

import pytest
import torch

from trainer.build import build_data
from trainer.compose import compose
from trainer.data import encode
from trainer.data.base import DataError
from trainer.data.packing import IGNORE_INDEX, Packer, SampleList, rows_to_tensors
from trainer.data.sources import CONVERSATIONS, hold_out
from trainer.data.summary import describe


def _data(recipe: str, overrides: list[str]):
    return build_data(compose(recipe, ["model=nano", "train.global_batch_size=8", *overrides]))


def _prompt_kept(row_ids: list[int], row_labels: list[int]) -> int:
    """Prompt tokens a pair row holds: the tokens before the first response token (labels are
    pre-shifted: label t is token t + 1)."""
    first_target = next(t for t, label in enumerate(row_labels) if label != IGNORE_INDEX)
    return first_target + 1


def test_cut_prompts_are_counted_from_the_rows_and_warned_about() -> None:
    data = _data(
        "dpo", ["data=preference_synthetic", "data.seq_len=32", "data.max_prompt_len=16", "data.sources.copy.limit=200"]
    )
    prepared, counts = data.prepare(), data.data_counts()["copy"]
    pairs, _ = data._records("copy", data.sources["copy"])
    template = data.chat_template(data.template_name, prepared.tokenizer)
    full = [len(encode.pair(prepared.tokenizer, p, template)[0]) for p in pairs]
    ids, labels = prepared.train["input_ids"][:, 0].tolist(), prepared.train["labels"][:, 0].tolist()
    held = [_prompt_kept(i, lab) for i, lab in zip(ids, labels)]
    assert counts.samples == len(pairs) == 200
    assert counts.prompts_cut == sum(h < f for h, f in zip(held, full)) > 0.9 * len(pairs)
    lines = describe(data)
    warning = next(line for line in lines if line.startswith("warning:"))
    assert "data.sources.copy" in warning and "raise data.seq_len (now 32; 39 keeps all)" in warning
    assert "or change data.max_prompt_len (now 16: the tokens a prompt keeps when its pair does not fit)" in warning


def test_the_shipped_presets_keep_every_sample_whole() -> None:
    # The preference preset's pairs fit whole (the learning tier's DPO entry depends on it); the
    # synthetic SFT preset refuses long samples, and the default SFT recipe splits them (counted as
    # split, not as cut).
    for recipe, overrides in (("dpo", ["data=preference_synthetic"]), ("sft", ["data=synthetic"]), ("sft", [])):
        counts = _data(recipe, overrides).data_counts()
        assert counts and all(c.affected == 0 and c.supervised_tokens_lost == 0 for c in counts.values()), (
            recipe,
            overrides,
        )


def test_truncated_conversations_count_the_supervised_tokens_the_samples_lose(tmp_path) -> None:
    def text(n: int, base: int) -> str:
        return " ".join(str(base + i) for i in range(n))

    rows = [
        {"messages": [{"role": "user", "content": text(n, 0)}, {"role": "assistant", "content": text(n, 500)}]}
        for n in (4, 40, 80, 6)
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    overrides = [
        f"data.sources={{mine: {{source: {path}, val_size: 0}}}}",
        "data.seq_len=64",
        "train.global_batch_size=1",
    ]
    whole = _data("sft", [*overrides, "data.long_samples=split"])
    cut = _data("sft", [*overrides, "data.long_samples=truncate"])

    def supervised(data) -> int:
        return sum(int((labels != IGNORE_INDEX).sum()) for labels in data.prepare().train["mine"].labels)

    counts = cut.data_counts()["mine"]
    assert whole.data_counts()["mine"].affected == 0
    long = int((whole.prepare().train["mine"].offsets[1:] - whole.prepare().train["mine"].offsets[:-1] > 64).sum())
    assert counts.truncated == long == 2 and counts.dropped == 0
    assert counts.supervised_tokens == supervised(cut)
    assert counts.supervised_tokens + counts.supervised_tokens_lost == supervised(whole)
    warning = next(line for line in describe(cut) if line.startswith("warning:"))
    assert (
        "data.sources.mine: 2 of 4 training conversations (50.0%)" in warning and "data.long_samples=split" in warning
    )

    # Split (kept whole): counted as split, with the supervised tokens that train without their
    # sample's start, read back from the packed rows (a piece's positions restart at 0) as the
    # SFT data module packs them: at least the counted ones (the packer may start a long sample
    # in a row's tail). Mutation: not counting split samples leaves the launch silent.
    split = whole.data_counts()["mine"]
    samples = whole.prepare().train["mine"]
    pairs = [(samples.ids[a:b], samples.labels[a:b]) for a, b in zip(samples.offsets[:-1], samples.offsets[1:])]
    rows = []
    packer = Packer(SampleList(pairs), seq_len=64, pad_id=0, policy="whole")
    while (row := packer.next_row()) is not None:
        rows.append(row)
    packed = rows_to_tensors(rows, num_rows=len(rows), seq_len=64, pad_id=0)
    real = packed["source_ids"].flatten() != -1
    positions, labels = packed["position_ids"].flatten()[real], packed["labels"].flatten()[real]
    index = torch.cat([torch.arange(b - a) for a, b in zip(samples.offsets[:-1], samples.offsets[1:])])
    unseen = int(((positions != index) & (labels != IGNORE_INDEX)).sum())
    assert split.split == long == 2 and split.affected == 0
    assert 0 < split.supervised_tokens_split <= unseen
    line = next(line for line in describe(whole) if line.startswith("warning:"))
    assert "2 of 4 training conversations (50.0%) are longer than a row" in line
    assert f"at least {split.supervised_tokens_split:,} of {split.supervised_tokens:,} supervised tokens" in line
    assert "data.long_samples=truncate" in line


def test_a_source_that_keeps_no_supervised_token_is_refused_naming_it() -> None:
    data = _data("sft", ["data.long_samples=drop", "data.seq_len=64"])
    with pytest.raises(
        DataError,
        match=r"data.sources.tool_use: none of its \d+ training conversations keeps a supervised token.*data.seq_len \(now 64",
    ):
        data.prepare()


def _chats_with_long_held_out(tmp_path, data, *, n: int = 8, val_size: int = 2) -> None:
    """Write ``n`` conversations to chats.jsonl, of which the ``val_size`` ones ``hold_out`` holds
    out (by content: the prompts' salt is searched for) have an answer of 60 numbers (longer than
    data.seq_len=64 tokens), the training ones of 4."""

    def row(i: int, salt: int) -> dict:
        answer = " ".join(str(500 + j) for j in range(60 if i < val_size else 4))
        return {"messages": [{"role": "user", "content": f"{salt} {i}"}, {"role": "assistant", "content": answer}]}

    for salt in range(1000):
        rows = [row(i, salt) for i in range(n)]
        records = [CONVERSATIONS.parse_row(r) for r in rows]  # as the source reads them
        _, held = hold_out(records, val_size, seed=data.seed, name="mine")
        if held == records[:val_size]:
            break
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _sft_on_file(tmp_path, policy: str):
    overrides = [
        f"data.sources={{mine: {{source: {tmp_path / 'chats.jsonl'}, val_size: 2}}}}",
        "data.seq_len=64",
        "train.global_batch_size=1",
    ]
    (tmp_path / "chats.jsonl").write_text("")
    return _data("sft", [*overrides, f"data.long_samples={policy}"])


def test_held_out_cuts_are_counted_from_the_held_out_rows_and_printed(tmp_path) -> None:
    data = _sft_on_file(tmp_path, "truncate")
    _chats_with_long_held_out(tmp_path, data)
    train, held_out = data.data_counts()["mine"], data.held_out_counts()["mine"]
    kept = sum(int((labels != IGNORE_INDEX).sum()) for labels in data.prepare().val["mine"].labels)
    assert train.affected == 0 and train.samples == 6
    assert held_out.samples == 2 and held_out.truncated == 2 and held_out.supervised_tokens == kept > 0
    lines = describe(data)
    assert any(
        line.startswith("data cuts (held-out, scored as cut): data.sources.mine: 2 conversations: 2 truncated")
        for line in lines
    ), lines
    assert not any(line.startswith("warning:") for line in lines)  # the training split is whole


def test_a_source_whose_held_out_samples_are_all_dropped_is_refused_naming_it(tmp_path) -> None:
    data = _sft_on_file(tmp_path, "drop")
    _chats_with_long_held_out(tmp_path, data)
    with pytest.raises(
        DataError,
        match=r"data.sources.mine: none of its 2 held-out conversations keeps a supervised token \(nothing left to score",
    ):
        data.prepare()


def test_a_run_that_repeats_its_pairs_says_how_often() -> None:
    """20 pairs drawn 8 a step for 200 steps are 80 epochs (a new user's preference source cycled
    in silence; SFT sources say their max_epochs); one pass or less says nothing, nor does a stream."""
    import types

    import torch

    from trainer.data.summary import epochs_line

    pairs = types.SimpleNamespace(train={"input_ids": torch.zeros(20, 2, 8, dtype=torch.long)})
    assert epochs_line(pairs, 8, 200) == "the run's 200 steps draw 8 pairs each: 80.0 epochs of the 20 training pairs"
    assert epochs_line(pairs, 8, 2) is None
    assert epochs_line(types.SimpleNamespace(train=None), 8, 200) is None


def test_a_held_out_row_trains_in_none_of_its_copies() -> None:
    """Before: rows were held out by index, so a file repeating a row could hold out one copy and
    train on another (a reviewer counted 5 of glaive's 16 held-out conversations in its training
    rows). Keyed by content, the split also stays put when rows are added or reordered."""
    rows = [{"prompt": f"q{i % 7}", "completion": "a"} for i in range(40)]  # 7 distinct, each repeated
    train, val = hold_out(rows, 3, seed=0, name="mine")
    assert len(val) == 3 and len({json.dumps(r) for r in val}) == 3
    assert not any(r in val for r in train) and len(train) + len(val) < len(rows)
    more = [{"prompt": "new", "completion": "b"}, *reversed(rows)]
    assert {json.dumps(r) for r in hold_out(more, 3, seed=0, name="mine")[1]} <= {
        json.dumps(r) for r in [*val, *more[:1]]
    }


@pytest.mark.parametrize("long_samples", ["split", "truncate"])
def test_one_long_sample_holding_most_tokens_is_warned_about(tmp_path, long_samples) -> None:
    """Before: the warning compared the share of samples only, so one long sample among 30 (3.2% of
    the samples, most of the supervised tokens) went unsaid (a reviewer's repro: 98.3% of a source's
    supervised tokens trained without their prompt)."""
    short = [{"prompt": "q", "completion": "a b"} for _ in range(30)]
    rows = [*short, {"prompt": "q", "completion": " ".join(str(i) for i in range(400))}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = _data(
        "sft",
        [
            f"data.sources={{mine: {{source: {path}, val_size: 0}}}}",
            "data.seq_len=64",
            f"data.long_samples={long_samples}",
        ],
    )
    counts = data.data_counts()["mine"]
    assert counts.samples == 31 and max(counts.split, counts.truncated) == 1
    lost = counts.supervised_tokens_split if long_samples == "split" else counts.supervised_tokens_lost
    assert lost > 0.5 * (
        counts.supervised_tokens + (counts.supervised_tokens_lost if long_samples == "truncate" else 0)
    )
    warning = [line for line in describe(data) if line.startswith("warning: data.sources.mine: 1 of 31")]
    assert (
        warning
        and f"({100 * lost / (counts.supervised_tokens + counts.supervised_tokens_lost if long_samples == 'truncate' else counts.supervised_tokens):.1f}%)"
        in warning[0]
    ), warning


def test_kto_rows_count_the_prompts_their_own_completions_cut(tmp_path) -> None:
    """Rows alternating a long prompt with a short answer and a short prompt with a long answer:
    each fits alone, so no prompt is cut (the KL row's borrowed completion is cut instead)."""
    import json

    def words(i: int) -> str:
        return " ".join(f"w{(i + j) % 37}" for j in range(30))

    rows = [
        {
            "prompt": words(i) if i % 2 else f"Say {i}.",
            "completion": f"yes {i}" if i % 2 else words(i),
            "label": i % 3 != 0,
        }
        for i in range(40)
    ]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data("kto", [f"data.sources={{mine: {{source: {tmp_path / 'kto.jsonl'}, val_size: 8}}}}", "data.seq_len=96",
                         "data.max_prompt_len=8", "data.vocab_size=300", "data.template=default"])  # fmt: skip
    data.prepare()
    counts = data.data_counts()["mine"]
    assert counts.samples == 32 and counts.prompts_cut == 0, counts


def test_pairs_the_cut_makes_identical_are_warned_about(tmp_path, capsys) -> None:
    """Responses that differ only in their last word, cut before it: the same row twice (loss ln 2,
    no gradient), reported only as a few tokens lost (a reviewer's run trained 20 steps on them)."""
    import json

    shared = " ".join(f"s{i}" for i in range(12))
    rows = [{"prompt": f"Question {i}?", "chosen": f"{shared} right", "rejected": f"{shared} wrong"} for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data("dpo", [f"data.sources={{mine: {{source: {tmp_path / 'p.jsonl'}, val_size: 4}}}}", "data.seq_len=16",
                         "data.max_prompt_len=4", "data.vocab_size=300", "data.template=default"])  # fmt: skip
    data.prepare()
    err = capsys.readouterr().err
    assert "data.sources.mine: 16 of 16 train pairs are the same row twice once cut" in err, err


def test_pairs_a_template_makes_identical_are_not_blamed_on_seq_len(tmp_path, capsys) -> None:
    """Rejected = chosen plus a space, under a template that trims: nothing cut, and raising
    data.seq_len cannot help (a reviewer's Llama 3-style template)."""
    import json

    from chat_templates import LLAMA3_STYLE, raw_tokenizer

    directory = tmp_path / "tok"
    directory.mkdir()
    raw_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": "", "chat_template": LLAMA3_STYLE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"Answer {i}. "} for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data("dpo", [f"data.sources={{mine: {{source: {tmp_path / 'p.jsonl'}, val_size: 4}}}}", "data.seq_len=128", "data.max_prompt_len=64",
                         f"data.tokenizer={directory / 'tokenizer.json'}", "data.template=tokenizer"])  # fmt: skip
    data.prepare()
    err = capsys.readouterr().err
    assert "16 of 16 train pairs are the same row twice once rendered and tokenized" in err, err
    assert "raise data.seq_len" not in err
