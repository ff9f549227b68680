"""The user's data paths, checked before anything reads them: what a path names, what a folder holds.

plait reads whole files. A path that is neither a regular file nor a folder (a FIFO, a socket, a
device) would block preparation or fail in its middle, and a folder entry named like data that
is no regular file (a dangling symlink, an empty folder named ``x.txt``) would be skipped without
a word. `check_path` and `data_files` refuse both, naming the entry; the readers
(`trainer.data.corpus`, `trainer.data.tables`) list folders with `data_files`, and
`trainer.semantics` runs the same checks on ``data.path`` before launch.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What plait reads as data: text and jsonl (trainer.data.corpus) and the tables of trainer.data.tables.
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow", ".json", ".csv")


# The config's local paths made absolute where the command is typed (`trainer.data.config_paths`), besides
# ``data.sources.<name>.source`` where it names no bundled or synthetic source (`trainer.data.config_paths.path_keys`).
PATH_KEYS = ("data.path", "data.tokenizer", "model.init_from", "model.config_from")
_SOURCE_KEY = re.compile(r"data\.sources\.[^.]+\.source")


def is_path_key(key: str) -> bool:
    """Whether the dotted ``key`` holds a local path `absolute_paths` may have made absolute (a
    source's ``source`` may also be a catalog name, which `absolute` leaves as it is)."""
    return key in PATH_KEYS or _SOURCE_KEY.fullmatch(key) is not None


def absolute(value: Any) -> Any:
    """A path as typed (``corpus/``, ``~/data``, ``../x.jsonl``), absolute and canonical
    (``/home/me/corpus``, symlinks resolved) when it exists from here; a list item by item; anything else (None, a
    path that does not exist: validate names it as typed) unchanged."""
    if isinstance(value, (list, tuple)):
        return [absolute(v) for v in value]
    if not isinstance(value, str) or not value or not os.path.exists(os.path.expanduser(value)):
        return value
    return os.path.realpath(os.path.expanduser(value))  # symlinks resolved before "..", as the OS reads it


class PathProblem(ValueError):
    """A data path, or an entry of a data folder, that is not a regular file or a folder."""


def _kind(path: Path) -> str:
    """What a path that is neither a regular file nor a folder is, for the message."""
    if path.is_symlink() and not path.exists():
        return "a dangling symlink"
    mode = path.stat().st_mode
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def check_path(given: str) -> Path:
    """``given`` with ``~`` expanded, when it names a regular file or a folder.

    Raises:
        FileNotFoundError: nothing is there.
        PathProblem: a FIFO, a socket or a device (reading it could block forever).
    """
    path = Path(given).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {given!r} does not exist")
    if not (path.is_file() or path.is_dir()):
        raise PathProblem(f"{given} is {_kind(path)}, not a regular file or a folder; copy the data into a file")
    return path


_SAID_HIDDEN: set[Path] = set()  # folders whose hidden files this process has reported


def _hidden(relative: Path) -> bool:
    """Whether a path below a data folder is hidden: one of its parts starts with ``.`` or ``__``."""
    return any(part.startswith((".", "__")) for part in relative.parts)


def data_files(root: Path, suffixes: Sequence[str]) -> list[Path]:
    """The regular files below the folder ``root`` whose suffix is one of ``suffixes``, sorted.

    A folder so named that holds such files itself (Spark writes ``out.parquet/part-*.parquet``)
    is read through them.

    Hidden entries, and what lies below them, are not data, as for Hugging Face ``datasets``: a
    name starting with ``.`` (Jupyter's ``.ipynb_checkpoints/`` copies, macOS's ``._x.jsonl``) or
    ``__`` (``__pycache__``); the first listing of a folder that has such files says how many it
    leaves out (a copy read as data would train twice on its rows and leak held-out ones).

    Raises:
        PathProblem: an entry so named that is a dangling symlink, a FIFO, a socket, a device, or
            a folder without such files.
    """
    named = [p for p in root.rglob("*") if p.suffix in suffixes]
    hidden = [p for p in named if _hidden(p.relative_to(root))]
    if hidden and root not in _SAID_HIDDEN:
        _SAID_HIDDEN.add(root)
        print(
            f"plait: {root}: left out {len(hidden)} hidden file(s) (names starting with . or __), e.g. "
            f"{hidden[0].relative_to(root)}",
            file=sys.stderr,
        )
    entries = sorted(p for p in named if not _hidden(p.relative_to(root)))
    files = [p for p in entries if p.is_file()]
    for entry in entries:
        if entry.is_dir() and not any(entry in f.parents for f in files):
            raise PathProblem(f"{entry} is a folder without data files, named like one; rename it or remove it")
        if not (entry.is_file() or entry.is_dir()):
            raise PathProblem(f"{entry} is {_kind(entry)}, not a regular file; remove it or replace it with the file")
    return files
