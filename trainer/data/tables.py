"""Rows of a user's data files, read with Hugging Face ``datasets`` (local paths only).

One reader for every table a user already has: ``.jsonl`` (read here line by line, so an error
names the line), and through ``datasets`` ``.json``, ``.parquet``, ``.arrow``, ``.csv``, a folder
of such shards (one format, read in sorted order) or a dataset written by ``save_to_disk``
(`load_from_disk`). Nothing downloads: ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set
before ``datasets`` is imported, and only local paths are accepted.

`read_rows` materialises ``(where, row)`` pairs (``where`` is ``"<file>, line 7"`` or
``"<path>, row 7"``, 1-based, for error messages). `stream` opens an ``IterableDataset`` (streaming
mode) whose ``state_dict`` / ``load_state_dict`` resume exactly where it stopped
(`trainer.data.stream`).

Column mapping: ``columns`` maps the field a format expects (``text``, ``messages``, ``prompt``,
``completion``, ``response``, ``chosen``, ``rejected``, ``label``) to the column that holds it in
the file, e.g. ``{messages: conversation}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.data.paths import PathProblem, check_path, data_files

# datasets reads these when it is imported: nothing of the Hub is ever contacted.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


def is_table(path: str) -> bool:
    """Whether ``path`` names a table this module reads (a file of `FORMATS` or a folder)."""
    p = Path(path).expanduser()
    return p.suffix in FORMATS or p.is_dir()


def _shards(root: Path) -> tuple[str, list[str]]:
    """(datasets builder name, sorted shard files) of a folder of data files of one format.

    Raises:
        ValueError: no data file, files of several formats, or an entry named like a data file
            that is not one (`trainer.data.paths.data_files`).
    """
    files = [p for p in data_files(root, tuple(FORMATS)) if p.name not in SAVED_MARKERS]
    kinds = {FORMATS[p.suffix] for p in files}
    if len(kinds) != 1:
        found = "no data files" if not kinds else f"files of several formats ({sorted(kinds)})"
        raise FormatProblem(
            f"{root}: {found}; a folder holds shards of one format ({', '.join(FORMATS)}) or a save_to_disk dataset"
        )
    return kinds.pop(), [str(p) for p in files]


class FormatProblem(ValueError):
    """A table this module refuses itself (its message names the fix)."""


def _parquet_footer(file: str) -> tuple[int, list[str]]:
    """The row count and column names in a parquet file's footer.

    Raises:
        FormatProblem: the file is no parquet file (a git-lfs pointer, a truncated copy), naming it.
    """
    import pyarrow.parquet  # lazy: ~0.3 s to import, needed only by parquet sources

    try:
        footer = pyarrow.parquet.ParquetFile(file)
    except (OSError, ValueError) as err:
        raise FormatProblem(
            f"{file}: not a readable parquet file ({_reason(err)}); replace it or move it away"
        ) from None
    return footer.metadata.num_rows, footer.schema_arrow.names


def empty_parquet(path: Path) -> bool:
    """Whether ``path`` is a parquet file without rows (a shard of a folder of text, left out); a
    file whose footer does not read is not (its reader names it)."""
    try:
        return path.suffix == ".parquet" and path.is_file() and _parquet_footer(str(path))[0] == 0
    except FormatProblem:
        return False


def _dataset(path: str, *, streaming: bool) -> Any:
    """The ``datasets`` Dataset (or IterableDataset when ``streaming``) of a local path.

    Raises:
        FileNotFoundError: no such path.
        ValueError: an unsupported file type, a path that is not a regular file or a folder
            (`trainer.data.paths.check_path`), a DatasetDict saved with several splits, a table
            without rows, or a file ``datasets`` cannot parse (its message included).
    """
    import datasets  # lazy: ~2 s to import, needed only by parquet and Hugging Face dataset sources

    datasets.disable_progress_bars()
    root = check_path(path)
    try:
        if root.is_dir() and any((root / m).is_file() for m in SAVED_MARKERS):
            data = datasets.load_from_disk(str(root))
            if isinstance(data, datasets.DatasetDict):
                if "train" not in data:
                    raise FormatProblem(
                        f"{path}: a saved DatasetDict without a 'train' split (has {sorted(data)}); point at one split's folder"
                    )
                if others := sorted(set(data) - {"train"}):
                    rows = sum(len(data[name]) for name in others)
                    print(
                        f"plait: {path}: a saved DatasetDict: its 'train' split is read, its {', '.join(others)} "
                        f"split(s) ({rows} rows) are not; point at a split's folder ({path}/<split>) to read another",
                        file=sys.stderr,
                    )
                data = data["train"]
            return data.to_iterable_dataset(num_shards=max(1, len(data.cache_files))) if streaming else data
        if root.is_dir():
            builder, files = _shards(root)
        elif root.suffix in FORMATS:
            builder, files = FORMATS[root.suffix], [str(root)]
        else:
            raise FormatProblem(
                f"{path}: unsupported file type; use {', '.join(FORMATS)}, a folder of shards or a save_to_disk folder"
            )
        if builder == "parquet":
            files = _parquet_shards(path, files)
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming)
    except (datasets.exceptions.DatasetGenerationError, OSError, TypeError, ValueError) as err:
        if isinstance(err, (FileNotFoundError, FormatProblem, PathProblem)):
            raise
        if "corresponds to no data" in str(err):  # a header-only csv, an empty json list
            raise FormatProblem(f"{path}: has no rows; add rows or point at another table") from None
        raise ValueError(f"{path}: datasets cannot read it ({_reason(err)})") from None


def _parquet_shards(path: str, files: list[str]) -> list[str]:
    """The parquet ``files`` that hold rows (``datasets`` cannot read an empty one: a writer's empty
    last shard); says how many it leaves out.

    Raises:
        FormatProblem: none holds a row, or shards whose columns differ (``datasets`` says only
            "Couldn't cast"), naming the first that differs from the first.
    """
    footers = {f: _parquet_footer(f) for f in files}
    kept = [f for f in files if footers[f][0]]
    if not kept:
        raise FormatProblem(f"{path}: has no rows; add rows or point at another table")
    first = footers[kept[0]][1]
    if other := next((f for f in kept if sorted(footers[f][1]) != sorted(first)), None):
        raise FormatProblem(
            f"{path}: its shards' columns differ: {Path(kept[0]).name} has {first}, {Path(other).name} has "
            f"{footers[other][1]}; write every shard with the same columns, or point at one shard"
        )
    if len(kept) < len(files):
        empty = [Path(f).name for f in files if f not in kept]
        print(
            f"plait: {path}: left out {len(empty)} parquet shard(s) without rows ({', '.join(empty[:3])})",
            file=sys.stderr,
        )
    return kept


def _reason(err: BaseException) -> str:
    """The first line of the innermost cause of ``err`` (``datasets`` wraps the parser's message,
    such as shards whose columns differ, in "An error occurred while generating the dataset")."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def rename(row: Mapping[str, Any], columns: Mapping[str, str] | None, where: str) -> dict[str, Any]:
    """``row`` with each mapped column under the field name a format expects.

    Raises:
        ValueError: a mapped column the row does not have (naming ``where`` and the columns it has).
    """
    if not columns:
        return dict(row)
    out = dict(row)
    for field, column in columns.items():
        if column not in row:
            swapped = (
                f" (the mapping reads {{plait's field: your column}}: {{{column}: {field}}})" if field in row else ""
            )
            raise ValueError(
                f"{where}: columns maps plait's field {field!r} to your column {column!r}, which the row lacks; its "
                f"columns are {sorted(row)}{swapped}; fix data.sources.<name>.columns"
            )
        out[field] = out.pop(column)
    return out


def check_unicode(value: Any, where: str) -> None:
    """Refuses text read from a JSON line whose escapes decode to a lone UTF-16 surrogate
    (``"\\ud800"`` without its pair): valid JSON, but no text, so its tokenizer or cache would fail
    later without naming the line. ``value``: what is trained on (a parsed record, a document's text).

    Raises:
        ValueError: ``<file>, line <n>: ...`` with the fix.
    """
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(err.object[err.start])
        raise ValueError(
            f"{where}: the escape \\u{code:04x} is half of a UTF-16 surrogate pair, not a character; write the "
            "whole pair (e.g. \\ud83d\\ude00) or the character itself, or remove it"
        ) from None


def read_rows(path: str, columns: Mapping[str, str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` of every row of a local table (module docstring), columns renamed.

    Raises:
        FileNotFoundError: no such path.
        ValueError: a line that is not a JSON object, or a table ``datasets`` cannot read.
    """
    file = Path(path).expanduser()
    if file.suffix == ".jsonl" and file.is_file():
        with file.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}, line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"{where}: not valid JSON ({err.msg}, column {err.colno}); write one JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: a {type(row).__name__}, not a JSON object; write one object per line")
                yield where, rename(row, columns, where)
        return
    for index, row in enumerate(_dataset(path, streaming=False), start=1):
        yield f"{path}, row {index}", rename(row, columns, f"{path}, row {index}")


def stream(path: str) -> Any:
    """A streaming ``datasets.IterableDataset`` of a local table (resumable: ``state_dict``)."""
    return _dataset(path, streaming=True)
