"""Named sources: ``data.sources.<name>.source`` -> the training and held-out records of one source.

A source string names a bundled real set (installed from a pip package), a synthetic task
(generated from the seed, with disjoint train and validation prompts) or a user's table: a
``.jsonl``/``.json``/``.parquet``/``.arrow``/``.csv`` file, a folder of shards or a dataset saved
with ``save_to_disk`` (read with Hugging Face ``datasets``: `trainer.data.tables`), in one of
TRL's formats (`trainer.data.formats`); ``columns`` maps a format's fields to the table's
columns. A `Catalog` lists the sources of one record kind: conversations for SFT
(`CONVERSATIONS`), preference pairs (`PAIRS`). To add a kind of source, teach `Catalog.records`
and `Catalog.problem` to recognise it; every data module that reads named sources takes it from
there.

Held-out records of a real set or a file are the ``val_size`` ones with the lowest hash of
(seed, source name, index) (`hold_out`): the same on every rank and in every process. A synthetic
task generates its own validation split. ``limit`` caps the training records (a synthetic task
generates that many, `SYNTHETIC_SIZE` by default).

Pretraining text is read by `trainer.data.default_corpus` (a list of bundled corpora) or
`trainer.data.corpus` (paths), split by ``val_fraction``, not through a catalog.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.data import formats, instructions, preference_sources, synthetic, tables
from trainer.data.base import DataError
from trainer.data.cache import digest
from trainer.data.paths import PathProblem, check_path, data_files

SYNTHETIC_SIZE = 1000  # training records a synthetic task generates without a limit
SOURCE_FIELDS = ("source", "limit", "val_size", "columns")  # the fields every named source has


def as_int(value: Any) -> int | None:
    """2e5 (Hydra parses it as a float) -> 200000; None stays None.

    Raises:
        ValueError: not a whole number.
    """
    if value is None:
        return None
    if float(value) != int(value):
        raise ValueError(f"{value} is not a whole number")
    return int(value)


@dataclass(frozen=True)
class Source:
    """One entry of ``data.sources``: its name, where its records come from, how many it keeps."""

    name: str
    source: str
    limit: int | None = None
    val_size: int = 16
    columns: tuple[tuple[str, str], ...] = ()  # (format field, table column) of a user's table


@dataclass(frozen=True)
class Catalog:
    """Where the records of one kind come from.

    Args:
        bundled: name -> loader of a real set.
        synthetic: name -> generator of disjoint ``{"train", "val"}`` splits (``seed``, ``sizes``).
        parse_row: one row of a user's table -> a record (raises `formats.FormatError`).
        example: a valid source, for the message of an empty ``data.sources``.
        useless: why a record teaches nothing (None: it is kept); such records are dropped with
            one line that counts them and names the first (`drop_useless`).
    """

    bundled: Mapping[str, Callable[[], list]]
    synthetic: Mapping[str, Callable[..., dict[str, list]]]
    parse_row: Callable[[Mapping[str, Any]], Any]
    example: str
    useless: Callable[[Any], str | None] = lambda record: None

    def names(self) -> list[str]:
        return sorted(self.bundled) + sorted(self.synthetic)

    def problem(self, name: str, source: Any) -> str | None:
        """What is wrong with ``data.sources.<name>.source=<source>``; None when it is valid.

        A local table must exist and be a regular file or a folder whose entries named like
        tables are regular files (`trainer.data.paths`; a FIFO would block preparation)."""
        if isinstance(source, str) and (source in self.bundled or source in self.synthetic):
            return None
        if isinstance(source, str) and tables.is_table(source):
            try:
                root = check_path(source)
                if root.is_dir():
                    data_files(root, tuple(tables.FORMATS))
            except (FileNotFoundError, PathProblem) as err:
                return f"data.sources.{name}.source={source}: {err}"
            return None
        return (
            f"data.sources.{name}.source={source!r}: use one of {self.names()} or a local path: a "
            f"{'/'.join(tables.FORMATS)} file, a folder of shards or a save_to_disk folder"
        )

    def parse(self, name: str, node: Mapping[str, Any], fields: tuple[str, ...] = SOURCE_FIELDS) -> Source:
        """The `Source` of ``data.sources.<name>`` (the fields the caller knows besides are its own).

        Raises:
            ValueError: an unknown field, an unknown source or a count that is not a whole number.
        """
        unknown = set(node) - set(fields)
        if unknown:
            raise ValueError(f"data.sources.{name}: unknown fields {sorted(unknown)}; valid: {sorted(fields)}")
        source = node.get("source", name)
        if (problem := self.problem(name, source)) is not None:
            raise ValueError(problem)
        columns = node.get("columns") or {}
        if not (hasattr(columns, "items") and all(isinstance(v, str) for v in columns.values())):
            raise ValueError(
                f"data.sources.{name}.columns={columns!r}: map each format field to a column name, e.g. {{messages: conversation}}"
            )
        try:
            limit, val_size = as_int(node.get("limit")), as_int(node.get("val_size", 16))
            return Source(
                name, source, limit=limit, val_size=val_size, columns=tuple((str(k), v) for k, v in columns.items())
            )
        except ValueError as err:
            raise ValueError(f"data.sources.{name}: {err}") from None

    def empty_problem(self) -> str:
        return f"data.sources is empty; name at least one source, e.g. data.sources.{self.example}"

    def records(self, source: Source, *, seed: int) -> tuple[list, list]:
        """``(train, val)`` records of one source.

        Raises:
            DataError: a missing data package, an unreadable or empty file or a synthetic task
                too small (naming ``data.sources.<name>``).
        """
        try:
            if source.source in self.synthetic:
                sizes = {"train": source.limit or SYNTHETIC_SIZE, "val": source.val_size}
                made = self.synthetic[source.source](source.source, seed=seed, sizes=sizes)
                return made["train"], made["val"]
            load = self.bundled.get(source.source)
            if load is not None:
                records, wheres = load(), None
            else:
                rows = list(tables.read_rows(source.source, dict(source.columns)))
                records, wheres = formats.read(iter(rows), self.parse_row), [where for where, _ in rows]
                if not records:
                    raise ValueError(f"{source.source} has no rows; add rows or remove data.sources.{source.name}")
        except (FileNotFoundError, ValueError) as err:  # a fix naming data.sources.<name>. names this source
            message = str(err).replace("data.sources.<name>.", f"data.sources.{source.name}.")
            raise DataError(f"data.sources.{source.name}: {message}") from None
        records, wheres = drop_useless(records, wheres, self.useless, name=source.name)
        warn_empty(records, wheres, name=source.name)
        train, val = hold_out(records, source.val_size, seed=seed, name=source.name)
        if copies := len(records) - len(train) - len(val):
            print(
                f"plait: data.sources.{source.name}: {copies} {'rows repeat' if copies > 1 else 'row repeats'} a "
                "held-out row: left out of training (the held-out rows stay unseen)",
                file=sys.stderr,
            )
        if source.val_size and not val:  # by content, copies of one row leave nothing unseen
            print(
                f"plait: warning: data.sources.{source.name}: "
                + (f"its {len(records)} rows are copies of one" if len(records) > 1 else "it has one row")
                + f", so none is held out (no val/loss/{source.name}); add distinct rows to score it",
                file=sys.stderr,
            )
        elif len(val) >= len(train):  # a small file: most of it would never be trained on, unsaid
            print(
                f"plait: warning: data.sources.{source.name}: {len(val)} of its {len(records)} rows are held out for "
                f"validation (val_size={source.val_size}) and {len(train)} train; lower it, e.g. "
                f"++data.sources.{source.name}.val_size={max(1, len(records) // 5)} (++ sets it whether or not the "
                "source's mapping names it)",
                file=sys.stderr,
            )
        return (train[: source.limit] if source.limit else train), val


def drop_useless(
    records: list, wheres: list[str] | None, useless: Callable[[Any], str | None], *, name: str
) -> tuple[list, list[str] | None]:
    """``(records, wheres)`` without the records ``useless`` names a reason for, counted in one
    ``plait:`` line on stderr that names the first one's file and line (``wheres[i]``, when the
    records come from a file).

    Raises:
        DataError: every record is useless (nothing would be trained or held out).
    """
    reasons = [useless(r) for r in records]
    dropped = [i for i, reason in enumerate(reasons) if reason is not None]
    if dropped:
        first = f" (first: {wheres[dropped[0]]})" if wheres else ""
        if len(dropped) == len(records):
            raise DataError(
                f"data.sources.{name}: all {len(records)} of its rows would be dropped: {reasons[dropped[0]]}{first}; "
                f"fix the rows or remove data.sources.{name}"
            )
        print(
            f"plait: data.sources.{name}: dropped {len(dropped)} of {len(records)} rows: {reasons[dropped[0]]}{first}",
            file=sys.stderr,
        )
    kept = [i for i, reason in enumerate(reasons) if reason is None]
    return [records[i] for i in kept], ([wheres[i] for i in kept] if wheres else wheres)


def empty_answer(record: Any) -> str | None:
    """What answer of a record is empty (after whitespace), which it trains or scores as nothing:
    a pair's ``chosen`` or ``rejected``, an unpaired row's ``completion``, a conversation's
    assistant turn, a standard row's completion; None when every answer has text."""
    if isinstance(record, list):
        return "an assistant turn is empty" if any(
            m["role"] == "assistant" and not m["content"].strip() for m in record
        ) else None  # fmt: skip
    for field in ("chosen", "rejected", "completion"):
        if isinstance(record, Mapping) and isinstance(record.get(field), str) and not record[field].strip():
            return f"'{field}' is empty"
    return None


def warn_empty(records: list, wheres: list[str] | None, *, name: str) -> None:
    """One ``plait: warning:`` line counting the records that have an empty answer (`empty_answer`),
    naming the first one's file and line (``wheres[i]``); they stay (an empty answer can be meant)."""
    found = [(i, reason) for i, r in enumerate(records) if (reason := empty_answer(r))]
    if found:
        first, reason = found[0]
        where = f" (first: {wheres[first]})" if wheres else ""
        print(
            f"plait: warning: data.sources.{name}: {len(found)} of {len(records)} rows have an empty answer: "
            f"{reason}{where}; fill or remove them if they are not meant",
            file=sys.stderr,
        )


def _tie(record: Mapping[str, Any]) -> str | None:
    # A pair whose answers are equal has no preference signal: its DPO loss is log 2 at a zero
    # gradient up to rounding, which AdamW's normalisation turns into real updates. Ties are
    # filtered out of preference sets (UltraFeedback binarized drops them), so drop, not refuse.
    if "chosen" in record and record.get("chosen") == record.get("rejected"):
        return "'chosen' equals 'rejected' (no preference signal)"
    return None


def hold_out(records: list, val_size: int, *, seed: int, name: str) -> tuple[list, list]:
    """``(train, val)``: the ``val_size`` distinct records (at most all but one) whose content has the
    lowest sha256 of (seed, name, content) are held out, one copy each, and every copy of them is
    left out of training; both keep the records' order.

    Keyed by content (canonical JSON), a record stays on its side when the rows are reordered, and
    a file that repeats a row cannot train on a held-out one (the bundled glaive tool-use rows
    repeat 35 of 300). Rows added or removed move the cutoff (the ``val_size`` lowest hashes): a
    new row hashing below it pushes the highest held-out row into training, a removed held-out row
    pulls the lowest training row out."""
    keys = [json.dumps(r, sort_keys=True, ensure_ascii=False, default=str) for r in records]
    distinct = list(dict.fromkeys(keys))
    scores = {key: digest(seed, name, key)[:8] for key in distinct}
    held = set(sorted(distinct, key=scores.__getitem__)[: min(val_size, len(distinct) - 1)])
    first = {key: i for i, key in reversed(list(enumerate(keys)))}
    val = [r for i, (r, key) in enumerate(zip(records, keys)) if key in held and first[key] == i]
    return [r for r, key in zip(records, keys) if key not in held], val


def _synthetic_conversations(task: str, *, seed: int, sizes: dict[str, int]) -> dict[str, list]:
    made = synthetic.examples(task, seed=seed, sizes=sizes)
    return {split: [synthetic.to_messages(e) for e in examples] for split, examples in made.items()}


CONVERSATIONS = Catalog(
    bundled=instructions.BUNDLED,
    synthetic=dict.fromkeys(synthetic.TASKS, _synthetic_conversations),
    parse_row=formats.conversation,
    example="general.source=alpaca",
)
PAIRS = Catalog(
    bundled=preference_sources.BUNDLED,
    synthetic=dict.fromkeys(preference_sources.SYNTHETIC, preference_sources.synthetic),
    parse_row=formats.preference,
    example="pairs.source=dpo_en",
    useless=_tie,
)
