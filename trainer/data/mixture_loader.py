"""Packing a `Mixture`'s sample stream into global batches, and a loader that resumes exactly.

Rows are filled in stream order. A sample that fits in a row is never split: if it does not fit
in what is left of the current row, the row is padded and the sample starts the next one. A
sample longer than a row fills the rest of the current row and continues in the next rows
(case C29: no crash, no token lost). Every row carries ``document_ids`` (one per sample or piece,
the pad tail its own), ``position_ids`` restarting per piece, pre-shifted ``labels`` and
``source_ids`` (the source index of each token, -1 on padding), so attention stays inside a
sample (C19) and the loss can be split per source.

The packer's state is the mixture state *before* the sample that straddles the batch boundary
plus the offset into it: drawing again from that state gives the same sample, so a resume lands
on the same token. If that sample's source was removed meanwhile (the mSFT controller), the rest
of the sample is skipped.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from trainer.data.mixture import Draw, Mixture
from trainer.data.packing import IGNORE_INDEX

Piece = tuple[int, np.ndarray, np.ndarray]  # (source index, ids, labels)


class MixturePacker:
    """Turns a mixture into rows of ``seq_len`` tokens (see module docstring)."""

    def __init__(self, mixture: Mixture, *, seq_len: int, pad_id: int) -> None:
        self.mixture, self.seq_len, self.pad_id = mixture, seq_len, pad_id
        self._pending: Draw | None = None
        self._pending_state: dict[str, Any] | None = None
        self._offset = 0
        self._resume: tuple[str | None, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            name = self.mixture.names[self._pending.source]
            return {"mixture": copy.deepcopy(self._pending_state), "offset": self._offset, "source": name}
        return {"mixture": self.mixture.state_dict(), "offset": 0, "source": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mixture.load_state_dict(state["mixture"])
        self._pending, self._offset = None, 0
        self._resume = (state["source"], state["offset"]) if state["offset"] else None

    def _peek(self) -> Draw | None:
        if self._pending is None:
            snapshot = self.mixture.state_dict()
            draw = self.mixture.draw()
            if draw is None:
                return None
            self._pending, self._pending_state, self._offset = draw, snapshot, 0
            if self._resume is not None:
                name, offset = self._resume
                if name == self.mixture.names[draw.source] and offset < len(draw.ids):
                    self._offset = offset
                self._resume = None
        return self._pending

    def next_row(self) -> list[Piece] | None:
        """The pieces of the next row; None when the mixture is exhausted."""
        pieces: list[Piece] = []
        space = self.seq_len
        while space > 0 and (draw := self._peek()) is not None:
            start, remaining = self._offset, len(draw.ids) - self._offset
            if remaining <= space:
                pieces.append((draw.source, draw.ids[start:], draw.labels[start:]))
                space -= remaining
                self._pending = None
            elif remaining <= self.seq_len and space < self.seq_len:
                break  # fits in a row of its own: never split it
            else:
                pieces.append((draw.source, draw.ids[start : start + space], draw.labels[start : start + space]))
                self._offset += space
                space = 0
        return pieces or None

    def exhausted(self) -> bool:
        return self._peek() is None


def rows_to_tensors(rows: list[list[Piece]], *, num_rows: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``[num_rows, seq_len]`` int64 tensors of packed rows; rows beyond ``rows`` are all padding."""
    input_ids = np.full((num_rows, seq_len), pad_id, dtype=np.int64)
    labels = np.full((num_rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.tile(np.arange(seq_len, dtype=np.int64), (num_rows, 1))
    document_ids = np.zeros((num_rows, seq_len), dtype=np.int64)
    source_ids = np.full((num_rows, seq_len), -1, dtype=np.int64)
    for r, pieces in enumerate(rows):
        col = 0
        for doc, (source, ids, labs) in enumerate(pieces):
            n = len(ids)
            input_ids[r, col : col + n], labels[r, col : col + n] = ids, labs
            position_ids[r, col : col + n] = np.arange(n)
            document_ids[r, col : col + n], source_ids[r, col : col + n] = doc, source
            col += n
        position_ids[r, col:] = np.arange(seq_len - col)
        document_ids[r, col:] = len(pieces)
    names = ("input_ids", "labels", "position_ids", "document_ids", "source_ids")
    return {k: torch.from_numpy(v) for k, v in zip(names, (input_ids, labels, position_ids, document_ids, source_ids))}


def supervised_per_source(rows: list[list[Piece]], num_sources: int) -> list[int]:
    counts = [0] * num_sources
    for pieces in rows:
        for source, _, labs in pieces:
            counts[source] += int((labs != IGNORE_INDEX).sum())
    return counts


class MixtureLoader:
    """Global batches of a mixture; this dp rank gets its contiguous slice of every batch's rows.

    One pass over the mixture (until every source's budget is spent) is one Lightning epoch; the
    last global batch is completed with padding rows (no target), so every supervised token of
    every budget is trained. The state is the position *trained*, not handed out (Lightning
    prefetches a batch): the Task calls `mark_trained` once per optimizer step, Lightning saves
    `state_dict` in every checkpoint and calls `load_state_dict` on resume.

    Args:
        make_packer: a fresh packer at the start of the mixture.
        names: source names, in source-index order.
        global_batch_size: rows per optimizer step over all dp ranks.
        dp_rank, dp_size: this rank on the data-parallel axis.
        dropped: supervised tokens per source that the long-sample policy cut before packing
            (logged with the consumed tokens as ``train/dropped_tokens/<source>``).
    """

    def __init__(
        self,
        make_packer: Callable[[], MixturePacker],
        *,
        names: list[str],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        dropped: dict[str, int] | None = None,
    ) -> None:
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of dp={dp_size}")
        self.make_packer, self.names = make_packer, list(names)
        self.dropped = dict(dropped or {})
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self._trained = {"packer": make_packer().state_dict(), "batches": 0, "tokens": dict.fromkeys(self.names, 0)}
        self._queue: deque[tuple[dict[str, Any], list[int], bool]] = deque()
        self._length: int | None = None
        self._exhausted: bool | None = None

    def _packer(self) -> MixturePacker:
        packer = self.make_packer()
        packer.load_state_dict(self._trained["packer"])
        return packer

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        packer, self._queue = self._packer(), deque()
        local = self.global_batch_size // self.dp_size
        rows_of_rank = slice(self.dp_rank * local, (self.dp_rank + 1) * local)
        while True:
            rows = []
            while len(rows) < self.global_batch_size and (row := packer.next_row()) is not None:
                rows.append(row)
            if not rows:
                return
            counts = supervised_per_source(rows, len(self.names))
            last = packer.exhausted()
            self._queue.append((packer.state_dict(), counts, last))
            mine = rows[rows_of_rank]
            yield rows_to_tensors(mine, num_rows=local, seq_len=packer.seq_len, pad_id=packer.pad_id)
            if last:
                return

    def mark_trained(self) -> dict[str, float]:
        """Advances the trained position by the oldest handed-out batch; returns the consumed
        supervised tokens per source so far (``train/consumed_tokens/<source>``)."""
        state, counts, last = self._queue.popleft()
        self._trained["packer"] = state
        self._trained["batches"] += 1
        for name, n in zip(self.names, counts):
            self._trained["tokens"][name] += n
        self._exhausted = last
        metrics = {f"train/consumed_tokens/{name}": float(n) for name, n in self._trained["tokens"].items()}
        return metrics | {f"train/dropped_tokens/{name}": float(n) for name, n in self.dropped.items()}

    @property
    def consumed_tokens(self) -> dict[str, int]:
        """Supervised tokens trained per source (over every pass so far)."""
        return dict(self._trained["tokens"])

    @property
    def exhausted(self) -> bool:
        """True once the trained position has reached the end of the mixture."""
        if self._exhausted is None:
            self._exhausted = self._packer().exhausted()
        return self._exhausted

    def __len__(self) -> int:
        """Global batches of the whole pass: those trained plus those left from the trained position.

        Lightning counts the batches of a resumed epoch from where it stopped, so the length must
        be that of the whole epoch, not of its rest (case C07)."""
        if self._length is None:
            packer, rows = self._packer(), 0
            while packer.next_row() is not None:
                rows += 1
            self._length = self._trained["batches"] + -(-rows // self.global_batch_size)
        return self._length

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._trained)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trained = copy.deepcopy(state)
        for name in self.names:  # a source added since the checkpoint starts at 0
            self._trained["tokens"].setdefault(name, 0)
        self._queue, self._length, self._exhausted = deque(), None, None
