"""Bad rows of the existing SFT/preference formats: one `DataError` (the CLI's ``plait: error:``,
exit 2, raised while the data is prepared, before any process group) naming the source, the file,
the line and the fix; pairs with equal answers are dropped with a count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.base import DataError
from trainer.data.sources import CONVERSATIONS, PAIRS

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _records(catalog, path: Path, rows: list) -> list:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = catalog.records(catalog.parse("mine", {"source": str(path), "val_size": 0}), seed=0)
    return train


def test_an_empty_sft_file_is_refused(tmp_path: Path) -> None:
    # Before: zero conversations, the run trained nothing and exited 0.
    with pytest.raises(
        DataError, match=r"data.sources.mine: .*d.jsonl has no rows; add rows or remove data.sources.mine"
    ):
        _records(CONVERSATIONS, tmp_path / "d.jsonl", [])


def test_a_conversation_without_an_assistant_turn_names_file_and_line(tmp_path: Path) -> None:
    # Before: a ChatError at encoding without the file or line ("a conversation without an assistant message ...").
    rows = [CHAT, {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(
        DataError, match=r"d.jsonl, line 2: 'messages' has no assistant turn.*add the assistant's answer"
    ):
        _records(CONVERSATIONS, tmp_path / "d.jsonl", rows)


def test_a_chosen_that_is_not_text_names_file_and_line(tmp_path: Path) -> None:
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": 7, "rejected": "b"}]
    with pytest.raises(DataError, match=r"d.jsonl, line 2: 'chosen' is int, not a string"):
        _records(PAIRS, tmp_path / "d.jsonl", rows)


def test_pairs_with_equal_answers_are_dropped_with_a_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the tie trained (its ~1e-7 noise gradient became AdamW updates).
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(3)]
    rows[1:1] = [{"prompt": "t", "chosen": "same", "rejected": "same"}] * 2
    kept = _records(PAIRS, tmp_path / "d.jsonl", rows)
    assert [p["chosen"] for p in kept] == ["a0", "a1", "a2"]
    err = capsys.readouterr().err
    assert (
        "plait: data.sources.mine: dropped 2 of 5 rows: 'chosen' equals 'rejected'" in err and "d.jsonl, line 2)" in err
    )


def test_a_small_file_mostly_held_out_is_said(tmp_path: Path, capsys) -> None:
    """Before: 10 rows at the default val_size=16 trained on 1 row without a word."""
    path = tmp_path / "d.jsonl"
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
        for i in range(10)
    ]
    path.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    train, val = CONVERSATIONS.records(CONVERSATIONS.parse("mine", {"source": str(path)}), seed=0)
    assert (len(train), len(val)) == (1, 9)
    assert (
        "plait: warning: data.sources.mine: 9 of its 10 rows are held out for validation (val_size=16) and 1 train; "
        "lower it, e.g. ++data.sources.mine.val_size=2 (++ sets it" in capsys.readouterr().err
    )
    CONVERSATIONS.records(CONVERSATIONS.parse("mine", {"source": str(path), "val_size": 2}), seed=0)
    assert "warning" not in capsys.readouterr().err


def test_a_file_of_one_repeated_row_holds_nothing_out_and_says_so(tmp_path: Path, capsys) -> None:
    """Held out by content, copies of one row leave nothing unseen to score: said, not silent."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(10)))
    train, val = CONVERSATIONS.records(CONVERSATIONS.parse("mine", {"source": str(path)}), seed=0)
    assert (len(train), len(val)) == (10, 0)
    assert (
        "plait: warning: data.sources.mine: its 10 rows are copies of one, so none is held out (no val/loss/mine)"
        in capsys.readouterr().err
    )


def test_a_source_whose_every_row_is_dropped_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: all 24 pairs dropped, then "warning: 0 of its 0 rows are held out ...; lower val_size".
    rows = [{"prompt": f"q{i}", "chosen": "same", "rejected": "same"} for i in range(4)]
    with pytest.raises(
        DataError,
        match=r"data.sources.mine: all 4 of its rows would be dropped: 'chosen' equals 'rejected'.*d.jsonl, line 1\); "
        r"fix the rows or remove data.sources.mine",
    ):
        _records(PAIRS, tmp_path / "d.jsonl", rows)
    assert "held out" not in capsys.readouterr().err


def test_rows_with_an_empty_answer_are_counted_in_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: 12 of 24 pairs with an empty 'rejected' and an empty assistant turn trained in silence.
    pairs = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": "" if i % 2 else f"b{i}"} for i in range(4)]
    pairs.insert(0, {"prompt": "t", "chosen": "", "rejected": ""})  # a tie: dropped, not counted as empty
    assert len(_records(PAIRS, tmp_path / "p.jsonl", pairs)) == 4
    err = capsys.readouterr().err
    assert "plait: warning: data.sources.mine: 2 of 4 rows have an empty answer: 'rejected' is empty" in err
    assert "p.jsonl, line 3)" in err
    chats = [CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}]
    assert len(_records(CONVERSATIONS, tmp_path / "c.jsonl", chats)) == 2
    assert "1 of 2 rows have an empty answer: an assistant turn is empty (first: " in capsys.readouterr().err
