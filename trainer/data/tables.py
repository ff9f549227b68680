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


def _parquet_rows(file: str) -> int:
    """The row count in a parquet file's footer (an empty table's, which ``datasets`` cannot read)."""
    import pyarrow.parquet  # lazy: ~0.3 s to import, needed only by parquet sources

    return pyarrow.parquet.ParquetFile(file).metadata.num_rows


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
        if builder == "parquet" and not sum(_parquet_rows(f) for f in files):
            raise FormatProblem(f"{path}: has no rows; add rows or point at another table")
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming)
    except (datasets.exceptions.DatasetGenerationError, OSError, TypeError, ValueError) as err:
        if isinstance(err, (FileNotFoundError, FormatProblem, PathProblem)):
            raise
        if "corresponds to no data" in str(err):  # a header-only csv, an empty json list
            raise FormatProblem(f"{path}: has no rows; add rows or point at another table") from None
        raise ValueError(
            f"{path}: datasets cannot read it ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
        ) from None


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
