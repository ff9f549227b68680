"""The data formats users already have: TRL's SFT and preference formats (strings or message
lists, the implicit prompt), KTO rows, tables read with Hugging Face ``datasets`` (parquet, a
save_to_disk folder, column mapping), a malformed row named by file and line, and a
``data.sources={...}`` override that replaces the bundled sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.compose import compose
from trainer.data.base import DataError
from trainer.data.sources import CONVERSATIONS, PAIRS

U, A = "user", "assistant"


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _records(catalog, path: str, **fields):
    train, val = catalog.records(catalog.parse("mine", {"source": path, "val_size": 0, **fields}), seed=0)
    assert val == []
    return train


def test_trl_sft_formats(tmp_path):
    rows = [
        {"messages": [{"role": U, "content": "hi"}, {"role": A, "content": "yo"}]},
        {"prompt": "2+2?", "completion": "4"},
        {
            "prompt": [{"role": "system", "content": "be terse"}, {"role": U, "content": "3+3?"}],
            "completion": [{"role": A, "content": "6"}],
        },
        {"prompt": "name?", "response": "plait"},
        {"text": "The sky is blue."},
    ]
    got = _records(CONVERSATIONS, _jsonl(tmp_path / "sft.jsonl", rows))
    # TRL's rule: string rows are standard (plain text, no chat template; tests/unit/test_sft_string_rows.py)
    assert got[1] == {"prompt": "2+2?", "completion": "4"}
    assert got[2] == [
        {"role": "system", "content": "be terse"},
        {"role": U, "content": "3+3?"},
        {"role": A, "content": "6"},
    ]
    assert got[3] == {"prompt": "name?", "completion": "plait"} and got[0][1]["content"] == "yo"
    assert got[4] == {"prompt": "", "completion": "The sky is blue."}


def test_trl_preference_formats(tmp_path):
    prompt = [{"role": U, "content": "sky?"}]
    rows = [
        {"prompt": "sky?", "chosen": "blue", "rejected": "green"},
        {"prompt": prompt, "chosen": [{"role": A, "content": "blue"}], "rejected": [{"role": A, "content": "green"}]},
        {"chosen": [*prompt, {"role": A, "content": "blue"}], "rejected": [*prompt, {"role": A, "content": "green"}]},
    ]
    want = {"messages": prompt, "chosen": "blue", "rejected": "green"}
    assert _records(PAIRS, _jsonl(tmp_path / "pairs.jsonl", rows)) == [want] * 3
    turns = [
        {"role": "system", "content": "terse"},
        *prompt,
        {"role": A, "content": "blue"},
        {"role": U, "content": "sure?"},
    ]
    multi = {"chosen": [*turns, {"role": A, "content": "yes"}], "rejected": [*turns, {"role": A, "content": "no"}]}
    assert _records(PAIRS, _jsonl(tmp_path / "multi.jsonl", [multi])) == [
        {"messages": turns, "chosen": "yes", "rejected": "no"}
    ]
    unpaired = _records(
        PAIRS, _jsonl(tmp_path / "kto.jsonl", [{"prompt": "sky?", "completion": "blue", "label": True}])
    )
    assert unpaired == [{"messages": prompt, "completion": "blue", "label": True}]


@pytest.mark.parametrize(
    ("catalog", "row", "says"),
    [
        (CONVERSATIONS, {"question": "x", "answer": "y"}, "'prompt' and 'completion'"),
        (CONVERSATIONS, {"prompt": "x", "completion": 3}, "'completion' is int"),
        (PAIRS, {"prompt": "x", "chosen": "y"}, "'prompt', 'chosen' and 'rejected'"),
        (
            PAIRS,
            {"prompt": "x", "chosen": [{"role": U, "content": "y"}], "rejected": [{"role": A, "content": "z"}]},
            "'chosen' must be one assistant turn",
        ),
        (
            PAIRS,
            {"prompt": "x", "chosen": [{"role": A, "content": "y"}], "rejected": "z"},
            "'chosen' is a message list and 'rejected' a string; give both as strings or both as message lists",
        ),
        (
            PAIRS,
            {"chosen": [{"role": A, "content": "y"}], "rejected": [{"role": A, "content": "z"}]},
            "share no prompt turn",
        ),
        (PAIRS, {"prompt": "x", "completion": "y", "label": "good"}, "use true (desirable)"),
        (
            PAIRS,
            {"prompt": "x", "completion": "y", "lable": True},
            "'completion' (strings or message lists) and 'label'",
        ),
        (PAIRS, {"prompt": "x", "label": False}, "'completion' (strings or message lists) and 'label'"),
    ],
)
def test_a_malformed_row_names_file_line_and_fix(tmp_path, catalog, row, says):
    good = (
        {"prompt": "a", "completion": "b"}
        if catalog is CONVERSATIONS
        else {"prompt": "a", "chosen": "b", "rejected": "c"}
    )
    path = _jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError, match="data.sources.mine: .*bad.jsonl, line 2: ") as err:
        _records(catalog, path)
    assert says in str(err.value)


def test_a_table_without_rows_says_so(tmp_path):
    import pandas as pd

    pd.DataFrame({"prompt": [], "completion": []}).astype(str).to_parquet(tmp_path / "empty.parquet")
    (tmp_path / "header.csv").write_text("prompt,completion\n")
    for name in ("empty.parquet", "header.csv"):
        with pytest.raises(DataError, match=f"data.sources.mine: .*{name}: has no rows; add rows"):
            _records(CONVERSATIONS, str(tmp_path / name))


def test_an_empty_shard_is_left_out_and_shards_whose_columns_differ_are_named(tmp_path, capsys):
    """A writer's empty last shard refused the whole folder ('datasets cannot read it (An error
    occurred while generating the dataset)'; under data=stream 'BatchSize must be greater than 0');
    shards with different columns said only "Couldn't cast"."""
    import pandas as pd

    rows = pd.DataFrame({"prompt": [f"{i}+1?" for i in range(6)], "completion": [str(i + 1) for i in range(6)]})
    (tmp_path / "shards").mkdir()
    rows.to_parquet(tmp_path / "shards" / "part-0.parquet")
    rows.iloc[:0].to_parquet(tmp_path / "shards" / "part-1.parquet")
    assert len(_records(CONVERSATIONS, str(tmp_path / "shards"))) == 6
    assert "left out 1 parquet shard(s) without rows (part-1.parquet)" in capsys.readouterr().err
    rows.assign(meta="x").to_parquet(tmp_path / "shards" / "part-2.parquet")
    with pytest.raises(
        DataError, match=r"its shards' columns differ: part-0.parquet has .*part-2.parquet has .*'meta'"
    ):
        _records(CONVERSATIONS, str(tmp_path / "shards"))


def test_parquet_saved_dataset_and_column_mapping(tmp_path):
    import datasets

    rows = {"question": ["2+2?", "3+3?"], "answer": ["4", "6"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "qa.parquet"))
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    columns = {"columns": {"prompt": "question", "completion": "answer"}}
    want = [{"prompt": q, "completion": a} for q, a in zip(rows["question"], rows["answer"])]  # strings: standard
    assert _records(CONVERSATIONS, str(tmp_path / "qa.parquet"), **columns) == want
    assert _records(CONVERSATIONS, str(tmp_path / "saved"), **columns) == want
    with pytest.raises(
        DataError,
        match=r"qa.parquet, row 1: columns maps plait's field 'prompt' to your column 'query', which the row lacks",
    ):
        _records(CONVERSATIONS, str(tmp_path / "qa.parquet"), columns={"prompt": "query"})
    # The mapping written the other way round ({your column: plait's field}) is named, with the source's own name.
    with pytest.raises(DataError, match=r"\(the mapping reads \{plait's field: your column\}: \{prompt: question\}\); "
                       r"fix data.sources.mine.columns"):  # fmt: skip
        _records(CONVERSATIONS, str(tmp_path / "qa.parquet"), columns={"question": "prompt"})
    assert "a local path" in CONVERSATIONS.problem("mine", "data.xlsx")


def test_a_source_set_to_null_is_removed(tmp_path):
    """In a recipe file Hydra merges data.sources into the preset's; a source set to null there (or
    by an override) is removed (a new user's file trained on all six sources beside its own; null
    was refused as data.sources.general.source='general')."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults: [sft, _self_]\ndata:\n  sources:\n    general: null\n    mine: {source: my.jsonl}\n")
    sources = compose(str(recipe)).data.sources
    assert "general" not in sources and sources.mine.source == "my.jsonl" and "code" in sources
    assert "general" not in compose("sft", ["data.sources.general=null"]).data.sources


def test_one_override_replaces_the_bundled_sources():
    cfg = compose("sft", ["data.sources={mine: {source: my.jsonl, limit: 3}}"])
    assert dict(cfg.data.sources) == {"mine": {"source": "my.jsonl", "limit": 3}}
    assert list(compose("dpo", ["data.sources={mine: {source: my.parquet}}"]).data.sources) == ["mine"]


def test_a_budget_on_a_parquet_source_is_exact(tmp_path):
    import datasets

    from trainer.build import build_data

    n = 40
    rows = {
        "prompt": [f"say {i} {i + 1}" for i in range(n)],
        "completion": [f"{i} {i + 1} {i + 2} done" for i in range(n)],
    }
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "a.parquet"))
    source = "{mine: {source: %s, max_tokens: 333, max_epochs: null, val_size: 2}}" % (tmp_path / "a.parquet")
    cfg = compose(
        "sft",
        [
            f"data.sources={source}",
            "data.vocab_size=300",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=32",
            "train.global_batch_size=4",
            "model=nano",
        ],
    )
    data = build_data(cfg)
    batches = data.train_batches(0, 1)
    position = batches.start()
    for _, position, _ in batches.batches(position):
        pass
    assert batches.metrics(position)["train/consumed_tokens/mine"] == 333.0  # supervised tokens, several epochs


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: not valid JSON \(.*, column 33\)"):
        _records(CONVERSATIONS, str(path))


def test_a_lone_surrogate_escape_names_its_line(tmp_path):
    """Before: valid JSON whose escape decodes to half a surrogate pair reached the cache's utf-8
    encoding and crashed with a UnicodeEncodeError naming no file (a reviewer's repro); a whole pair
    is a character and is kept."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "a", "completion": "\\ud83d\\ude00"}\n{"prompt": "x", "completion": "\\ud800 bad"}\n')
    with pytest.raises(DataError, match=r"s\.jsonl, line 2: the escape \\ud800 is half of a UTF-16 surrogate pair"):
        _records(CONVERSATIONS, str(path))
    path.write_text('{"prompt": "a", "completion": "\\ud83d\\ude00"}\n' * 3)
    assert "\U0001f600" in json.dumps(_records(CONVERSATIONS, str(path)), ensure_ascii=False)


def test_a_lone_surrogate_in_a_column_left_out_is_no_problem(tmp_path):
    """Only the fields trained on are checked (a reviewer: a 'meta' column with \\ud800 refused the file)."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "a", "completion": "b", "meta": "\\ud800"}\n' * 3)
    assert len(_records(CONVERSATIONS, str(path))) == 3


def test_a_csv_column_of_numbers_names_a_format_that_keeps_text(tmp_path):
    """datasets types a CSV column of numbers as numbers ('42'), with no way to mark it as text in
    the file: the refusal names a format that keeps text."""
    (tmp_path / "sums.csv").write_text("prompt,completion\nWhat is 40 + 2?,42\nWhat is 1 + 1?,2\n")
    with pytest.raises(DataError, match=r"'completion' is int, .*save such a table as .jsonl or .parquet"):
        _records(CONVERSATIONS, str(tmp_path / "sums.csv"))


def test_a_shard_that_is_no_parquet_file_is_named(tmp_path):
    """A git-lfs pointer saved as a shard: 'Parquet magic bytes not found' named no file."""
    import pandas as pd

    from trainer.data.corpus import load_files

    (tmp_path / "shards").mkdir()
    pd.DataFrame({"text": ["a document"], "prompt": ["1+1?"], "completion": ["2"]}).to_parquet(
        tmp_path / "shards" / "part-0.parquet"
    )
    pointer = tmp_path / "shards" / "part-1.parquet"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    with pytest.raises(DataError, match=rf"{pointer}: not a readable parquet file"):
        _records(CONVERSATIONS, str(tmp_path / "shards"))
    with pytest.raises(ValueError, match=rf"{pointer}"):
        load_files([str(tmp_path / "shards")])


def test_a_csv_column_of_conversations_as_json_text_is_read_as_conversations(tmp_path):
    """A CSV cell can hold no list: a 'messages' column of JSON text was read as one user turn and
    refused ('has no assistant turn')."""
    import csv

    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    with open(tmp_path / "chats.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["messages"])
        writer.writerow([json.dumps(chat)])
        writer.writerow([json.dumps(chat[:1] + [{"role": "assistant", "content": "four"}])])
    assert _records(CONVERSATIONS, str(tmp_path / "chats.csv"))[0] == chat


def test_json_text_messages_in_any_field_of_a_csv_and_prompts_that_only_look_like_lists(tmp_path):
    """A preference row's prompt and a KTO row's completion as JSON text were trained on as the
    literal JSON; a prompt like '[1, 2, 3] sorted?' stays text."""
    import csv

    user, answer = [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}]
    with open(tmp_path / "pairs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "chosen", "rejected"])
        writer.writerow([json.dumps(user), json.dumps(answer), json.dumps([{"role": "assistant", "content": "5"}])])
        writer.writerow(["[1, 2, 3] sorted?", "yes", "no"])
    first, second = _records(PAIRS, str(tmp_path / "pairs.csv"))
    assert first["messages"] == user and first["chosen"] == "4"
    assert second["messages"] == [{"role": "user", "content": "[1, 2, 3] sorted?"}]


def test_a_saved_dataset_dict_says_which_splits_it_leaves_unread(tmp_path, capsys):
    """Its 'train' split was read and a 'test' split beside it ignored without a word."""
    import datasets

    rows = {"prompt": ["2+2?", "3+3?"], "completion": ["4", "6"]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows)}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(_records(CONVERSATIONS, str(tmp_path / "dd"))) == 2
    assert "its 'train' split is read, its test split(s) (2 rows) are not" in capsys.readouterr().err
