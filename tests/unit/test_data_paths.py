"""Data paths that are not regular files or folders are refused by validate, before anything reads
them (a FIFO would block), and so are folder entries named like data that are not regular files
(a dangling symlink or a folder named ``x.txt`` was skipped without a word)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import compose_config

from trainer.config import ConfigError, validate
from trainer.data.corpus import load_files
from trainer.data.paths import PathProblem, data_files


def _problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_config([f"data.path={path}"]))
    return err.value.problems


def test_a_fifo_as_data_path_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "corpus.txt")
    assert _problems(tmp_path / "corpus.txt") == [
        f"data.path={tmp_path / 'corpus.txt'}: {tmp_path / 'corpus.txt'} is a FIFO, not a regular file or a folder; "
        "copy the data into a file"
    ]


@pytest.mark.parametrize("entry", ["dangling symlink", "folder", "fifo"])
def test_a_folder_entry_named_like_data_must_be_a_regular_file(tmp_path: Path, entry: str) -> None:
    (tmp_path / "a.txt").write_text("some text\n")
    bad = tmp_path / "b.txt"
    if entry == "dangling symlink":
        bad.symlink_to(tmp_path / "missing.txt")
    elif entry == "folder":
        bad.mkdir()
    else:
        os.mkfifo(bad)
    kind = {"dangling symlink": "a dangling symlink", "folder": "a folder without data files", "fifo": "a FIFO"}[entry]
    problems = _problems(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(f"data.path={tmp_path}: {bad} is {kind}"), problems
    with pytest.raises(PathProblem, match=f"{bad} is {kind}"):  # the reader lists the folder the same way
        load_files([str(tmp_path)])


def test_a_folder_named_like_data_that_holds_data_is_read_through(tmp_path: Path) -> None:
    (tmp_path / "out.parquet").mkdir()  # as Spark writes a table
    (tmp_path / "out.parquet" / "part-0.parquet").write_bytes(b"")
    (tmp_path / "notes.md").mkdir()  # not named like data: not looked at
    assert data_files(tmp_path, (".parquet",)) == [tmp_path / "out.parquet" / "part-0.parquet"]


def test_a_fifo_as_a_named_source_is_refused(tmp_path: Path) -> None:
    """SFT and preference sources read local tables too (`trainer.data.sources.Catalog.problem`)."""
    os.mkfifo(tmp_path / "mine.jsonl")
    cfg = compose_config([f"data.sources={{mine: {{source: '{tmp_path / 'mine.jsonl'}'}}}}"], recipe="sft", tiny=False)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert f"data.sources.mine.source={tmp_path / 'mine.jsonl'}: {tmp_path / 'mine.jsonl'} is a FIFO" in str(err.value)


def test_hidden_files_in_a_data_folder_are_not_data(tmp_path: Path, capsys) -> None:
    """Jupyter's checkpoint copy and macOS's ``._`` file beside the data (a reviewer's folder: the
    copy doubled the 200 documents and put every held-out one in training too; the ``._`` file
    refused the run with a nameless decode error). Left out, as ``datasets`` does, and said once."""
    rows = "".join(f'{{"text": "document {i}"}}\n' for i in range(5))
    (tmp_path / "corpus.jsonl").write_text(rows)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "corpus-checkpoint.jsonl").write_text(rows)
    (tmp_path / "._corpus.jsonl").write_bytes(b"\x00\x05\x16\x07\xff\xfe")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.json").write_text("[]")
    assert data_files(tmp_path, (".jsonl", ".json")) == [tmp_path / "corpus.jsonl"]
    assert [d.text for d in load_files([str(tmp_path)])] == [f"document {i}" for i in range(5)]
    err = capsys.readouterr().err
    assert err.count(f"plait: {tmp_path}: left out 3 hidden file(s)") == 1, err
