"""The packer: a stream of token samples -> fixed-length rows with document ids and positions.

Label convention (the whole trainer relies on it): labels are PRE-SHIFTED. ``labels[t]`` is the
target for the logits at position ``t``; nothing downstream shifts again (case C21). Positions
that predict nothing hold ``IGNORE_INDEX`` (-100). ``shift_labels`` is the single place where
the causal-LM shift happens.

A packed row holds several samples (or pieces of one long sample) back to back. Per position it
carries:

- ``document_ids``: 0, 1, 2, ... per sample or piece, restarting at 0 in every row; the pad tail
  of a row gets one more id of its own. Attention is block-diagonal causal over equal ids, so no
  sample sees another (case C19).
- ``position_ids``: 0, 1, 2, ... restarting for every sample, every piece of a split sample and
  the pad tail, so RoPE sees each document as if it were alone.
- ``labels``: as given by the sample, pads -100. A sample made with ``shift_labels`` ends in
  -100, so no target crosses a document boundary (C19); a sample split across rows keeps its
  given labels, so the last token of a piece still predicts the next token of the same sample.
- ``source_ids``: the index of the sample's source, -1 on padding (per-source losses).

Two policies (`POLICIES`), one `Packer`:

- ``split``: every row is filled; a sample that does not fit in the rest of a row continues in
  the next one (pretraining: no padding but in the last row);
- ``whole``: a sample that fits in a row is never cut: if it does not fit in the rest of the
  current row, the row is padded and the sample starts the next one. A sample longer than a row
  fills the rest of the current row and continues in the next rows (case C29: no crash, no token
  lost).

The packer draws from a `SampleStream` (a `SampleList`, or the SFT `Mixture`). Its state is the
stream's state *before* the sample that straddles a row boundary plus the offset into it:
drawing again from that state gives the same sample, so a resume lands on the same token. If
that sample's source changed meanwhile (the mSFT controller removed it), the rest of the sample
is skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from trainer.data.accounting import SourceCounts

IGNORE_INDEX = -100
POLICIES = ("split", "whole")
ROW_KEYS = ("input_ids", "labels", "position_ids", "document_ids", "source_ids")

_Ids = TypeVar("_Ids", list, Tensor)


def shift_labels(input_ids: _Ids) -> _Ids:
    """The causal-LM shift: ``input_ids[1:] + [IGNORE_INDEX]``.

    Args:
        input_ids: a list of ids, a 1-D tensor ``[S]`` or a 2-D tensor ``[B, S]``. A 2-D tensor is
            shifted per row; no target ever comes from the next row (case C21).

    Returns:
        The targets, same type and shape; the last position of each row is ``IGNORE_INDEX``.
    """
    if isinstance(input_ids, Tensor):
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[..., :-1] = input_ids[..., 1:]
        return labels
    return list(input_ids[1:]) + [IGNORE_INDEX] if len(input_ids) else []


@dataclass
class Draw:
    """One sample of a stream: its source index, ids and pre-shifted labels (equal lengths), and
    its supervised tokens."""

    source: int
    ids: np.ndarray
    labels: np.ndarray
    supervised: int


Piece = tuple[int, np.ndarray, np.ndarray]  # (source index, ids, labels) of one row


class SampleStream(Protocol):
    """What the packer draws from: samples in a fixed order, with a state to resume from."""

    names: list[str]  # source names, by source index

    def draw(self) -> Draw | None:
        """The next non-empty sample; None at the end."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SampleList:
    """A list of ``(ids, labels)`` samples as a `SampleStream` of one source (empty ones skipped)."""

    def __init__(self, samples: Sequence[tuple[Sequence[int], Sequence[int]]], name: str = "samples") -> None:
        self.samples, self.names, self.index = samples, [name], 0

    def draw(self) -> Draw | None:
        while self.index < len(self.samples):
            ids, labels = self.samples[self.index]
            self.index += 1
            if len(ids):
                labels = np.asarray(labels, dtype=np.int64)
                return Draw(0, np.asarray(ids, dtype=np.int64), labels, int((labels != IGNORE_INDEX).sum()))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


class Packer:
    """Rows of ``seq_len`` tokens from a sample stream (see module docstring).

    Args:
        stream: where samples come from.
        seq_len: row length S.
        pad_id: input id of pad positions.
        policy: ``split`` or ``whole`` (see module docstring).

    Raises:
        ValueError: ``seq_len`` < 1 or an unknown policy.
    """

    def __init__(self, stream: SampleStream, *, seq_len: int, pad_id: int, policy: str = "whole") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if policy not in POLICIES:
            raise ValueError(f"packing policy {policy!r}: use one of {POLICIES}")
        self.stream, self.seq_len, self.pad_id, self.policy = stream, seq_len, pad_id, policy
        self._pending: Draw | None = None
        self._pending_state: dict[str, Any] | None = None
        self._offset = 0
        self._resume: tuple[str | None, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        # "mixture": the stream's state (the key checkpoints and the mSFT controller read).
        if self._pending is not None:
            name = self.stream.names[self._pending.source]
            return {"mixture": copy.deepcopy(self._pending_state), "offset": self._offset, "source": name}
        return {"mixture": self.stream.state_dict(), "offset": 0, "source": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["mixture"])
        self._pending, self._offset = None, 0
        self._resume = (state["source"], state["offset"]) if state["offset"] else None

    def _peek(self) -> Draw | None:
        if self._pending is None:
            snapshot = self.stream.state_dict()
            draw = self.stream.draw()
            if draw is None:
                return None
            self._pending, self._pending_state, self._offset = draw, snapshot, 0
            if self._resume is not None:
                name, offset = self._resume
                if name == self.stream.names[draw.source] and offset < len(draw.ids):
                    self._offset = offset
                self._resume = None
        return self._pending

    def next_row(self) -> list[Piece] | None:
        """The pieces of the next row; None when the stream is exhausted."""
        pieces: list[Piece] = []
        space = self.seq_len
        while space > 0 and (draw := self._peek()) is not None:
            start, remaining = self._offset, len(draw.ids) - self._offset
            if remaining <= space:
                pieces.append((draw.source, draw.ids[start:], draw.labels[start:]))
                space -= remaining
                self._pending = None
            elif self.policy == "whole" and remaining <= self.seq_len and space < self.seq_len:
                break  # fits in a row of its own: never cut it
            else:
                pieces.append((draw.source, draw.ids[start : start + space], draw.labels[start : start + space]))
                self._offset += space
                space = 0
        return pieces or None

    def exhausted(self) -> bool:
        return self._peek() is None


def rows_to_tensors(rows: list[list[Piece]], *, num_rows: int, seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """``[num_rows, seq_len]`` int64 tensors (`ROW_KEYS`) of packed rows; rows beyond ``rows`` are
    all padding. The one place a row is laid out (see module docstring); vectorised numpy, no
    per-token Python (the default corpus, ~2.7 M tokens, in well under a second)."""
    pieces = [(r, piece) for r, row in enumerate(rows) for piece in row]
    count = len(pieces)
    row_of = np.fromiter((r for r, _ in pieces), dtype=np.int64, count=count)
    lengths = np.fromiter((len(p[1]) for _, p in pieces), dtype=np.int64, count=count)
    starts = np.cumsum(lengths) - lengths  # of each piece in the concatenated stream
    first = np.searchsorted(row_of, row_of, side="left")  # the first piece of each piece's row
    doc, col = np.arange(count) - first, starts - starts[first]
    fill = np.bincount(row_of, weights=lengths, minlength=num_rows).astype(np.int64)
    # All-pad rows first: the pad tail of row r is one more document, positions 0, 1, ...
    input_ids = np.full((num_rows, seq_len), pad_id, dtype=np.int64)
    labels = np.full((num_rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.arange(seq_len, dtype=np.int64)[None, :] - fill[:, None]
    document_ids = np.repeat(np.bincount(row_of, minlength=num_rows)[:, None], seq_len, axis=1)
    source_ids = np.full((num_rows, seq_len), -1, dtype=np.int64)
    # Token k of piece i goes to flat index row_i * S + col_i + k.
    total = int(lengths.sum())
    offset = np.arange(total) - np.repeat(starts, lengths)
    flat = np.repeat(row_of * seq_len + col, lengths) + offset
    concat = (
        (lambda k: np.concatenate([p[k] for _, p in pieces]).astype(np.int64))
        if count
        else (lambda k: np.empty(0, np.int64))
    )
    input_ids.reshape(-1)[flat], labels.reshape(-1)[flat] = concat(1), concat(2)
    position_ids.reshape(-1)[flat] = offset
    document_ids.reshape(-1)[flat] = np.repeat(doc, lengths)
    source_ids.reshape(-1)[flat] = np.repeat(
        np.fromiter((p[0] for _, p in pieces), dtype=np.int64, count=count), lengths
    )
    columns = (input_ids, labels, position_ids, document_ids, source_ids)
    return {k: torch.from_numpy(v) for k, v in zip(ROW_KEYS, columns)}


@dataclass
class PackedRows:
    """``N`` packed rows of length ``S``; all fields are ``[N, S]`` int64 tensors (`ROW_KEYS`).

    ``source_ids`` marks the pad tails with -1 (a routed model leaves them out of its routers:
    `strategies.core.model_contract.model_inputs`); rows given without it have no mark: 0 everywhere.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    document_ids: Tensor
    source_ids: Tensor | None = None

    def __post_init__(self) -> None:
        if self.source_ids is None:
            self.source_ids = torch.zeros_like(self.input_ids)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        """Row ``i`` as ``{"input_ids", "labels", "position_ids", "document_ids", "source_ids"}``, each ``[S]``."""
        return {k: v[i] for k, v in vars(self).items()}

    def num_supervised_tokens(self) -> int:
        """Number of positions with a target (label != -100) over all rows."""
        return int((self.labels != IGNORE_INDEX).sum())

    def token_id_problem(self, vocab_size: int) -> str | None:
        """Why these rows cannot come from a tokenizer of ``vocab_size`` ids (an input id or a
        target outside ``[0, vocab_size)``, which the embedding or the loss would index with), or None."""
        targets = self.labels[self.labels != IGNORE_INDEX]
        for name, ids in (("token id", self.input_ids), ("target", targets)):
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
                return f"a {name} in [{int(ids.min())}, {int(ids.max())}] outside the vocabulary of {vocab_size}"
        return None


def pack(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]], *, seq_len: int, pad_id: int, policy: str = "split"
) -> PackedRows:
    """All rows of ``(input_ids, labels)`` samples, packed in order (see module docstring).

    Args:
        samples: pairs of equal-length id sequences; labels are pre-shifted. Empty ones are skipped.
        seq_len: row length S.
        pad_id: input id of pad positions (their label is -100).
        policy: ``split`` (fill every row) or ``whole`` (never cut a sample that fits in a row).

    Returns:
        ``PackedRows`` with N = number of rows (0 rows for no tokens).

    Raises:
        ValueError: a sample whose input_ids and labels differ in length; ``seq_len`` < 1.
    """
    for i, (ids, labels) in enumerate(samples):
        if len(ids) != len(labels):
            raise ValueError(f"sample {i}: {len(ids)} input_ids but {len(labels)} labels; they must be equal")
    packer = Packer(SampleList(samples), seq_len=seq_len, pad_id=pad_id, policy=policy)
    rows = []
    while (row := packer.next_row()) is not None:
        rows.append(row)
    tensors = rows_to_tensors(rows, num_rows=len(rows), seq_len=seq_len, pad_id=pad_id)
    return PackedRows(**tensors)


LONG_SAMPLES = ("split", "truncate", "drop", "error")


def fit_long_samples(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]], *, seq_len: int, policy: str
) -> tuple[list[tuple[Sequence[int], Sequence[int]]], SourceCounts]:
    """Applies a long-sample policy before packing: the kept samples, and what was cut.

    Args:
        samples: ``(ids, labels)`` pairs.
        seq_len: the row length.
        policy: for samples longer than ``seq_len``: ``split`` (kept whole; the ``whole`` packer
            continues them in the next rows, C29), ``truncate`` (first ``seq_len`` tokens),
            ``drop`` (left out) or ``error``.

    Returns:
        The samples to pack, and the counts of every sample (`trainer.data.accounting.SourceCounts`:
        samples dropped or truncated by the policy, supervised tokens kept and lost; under
        ``split``, the samples split and their supervised tokens past the first ``seq_len``).

    Raises:
        ValueError: a long sample under ``policy="error"`` (the message names the fixes).
    """
    kept, counts = [], SourceCounts()
    for ids, labels in samples:
        supervised = np.asarray(labels) != IGNORE_INDEX
        cut = len(ids)
        if len(ids) > seq_len and policy != "split":
            if policy == "error":
                raise ValueError(
                    f"a sample of {len(ids)} tokens is longer than data.seq_len={seq_len}; set "
                    "data.long_samples=split (continue in the next row), truncate or drop, or raise data.seq_len"
                )
            cut = 0 if policy == "drop" else seq_len
        lost = int(supervised[cut:].sum())
        split = int(supervised[seq_len:].sum()) if policy == "split" and len(ids) > seq_len else None
        counts.add(
            supervised_kept=int(supervised.sum()) - lost,
            supervised_lost=lost,
            dropped=cut == 0 < len(ids),
            supervised_split=split,
        )
        if cut or not len(ids):
            kept.append((ids[:cut], labels[:cut]) if cut < len(ids) else (ids, labels))
    return kept, counts
