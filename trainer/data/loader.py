"""The one train loader: global batches, and a state that is the position *trained*.

Lightning fetches a batch ahead of the one it trains on, so a loader that counted the batches it
handed out would resume one batch late. `Loader` keeps, for every batch it hands out, the
position after it; the Task calls `mark_trained` once per optimizer step, which makes the oldest
one the trained position. Lightning saves `state_dict` in every checkpoint and calls
`load_state_dict` on resume (it detects the two methods), so a run resumes on the first batch
it did not train, also in the middle of an epoch (case C07).

Where the batches come from is a `GlobalBatches` stream; each yields this dp rank's contiguous
slice of every global batch, so the batches do not depend on the world size:

- `RowBatches`: fixed rows (pretraining rows, preference pairs) in the order of a
  `GlobalBatchSampler`; epochs repeat until ``trainer.max_steps``; the position is
  ``{"epoch", "trained"}`` (global batches of the epoch trained).
- `PackedBatches`: rows packed on the fly from a `Mixture` (SFT); one pass over the mixture is
  the run; the position is ``{"packer", "batches", "tokens"}`` (packer state, global batches and
  supervised tokens per source trained).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from trainer import protocols
from trainer.data.balance import Balancer
from trainer.data.packing import IGNORE_INDEX, Packer, Piece, rows_to_tensors
from trainer.data.sampler import GlobalBatchSampler

Batch = dict[str, Tensor]
Position = dict[str, Any]


class GlobalBatches(Protocol):
    """A resumable stream of global batches (what `Loader` needs)."""

    def start(self) -> Position:
        """The position before the first batch."""

    def batches(self, position: Position) -> Iterator[tuple[Batch, Position, bool]]:
        """From ``position`` on: this rank's rows of each global batch, the position after it, and
        whether it is the last batch of the data."""

    def num_batches(self, position: Position) -> int:
        """Global batches of the whole epoch (or pass) that ``position`` is in."""

    def restore(self, state: Position) -> Position:
        """The position to continue from after a checkpoint's ``state``."""

    def exhausted(self, position: Position) -> bool:
        """Whether the data ends at ``position`` (finite data only)."""

    def metrics(self, position: Position) -> dict[str, float]:
        """Values to log at the trained ``position`` (e.g. supervised tokens per source)."""


class Loader(protocols.Loader):
    """Batches of a `GlobalBatches` stream; its state is the trained position (module docstring).

    ``pin_memory`` (on when CUDA is available) hands out page-locked batches, so Lightning's
    ``non_blocking`` copy to the GPU is asynchronous (overlaps the previous step's kernels).
    """

    def __init__(self, batches: GlobalBatches, *, pin_memory: bool = False) -> None:
        self.batches = batches
        self.pin_memory = pin_memory
        self._trained = batches.start()
        self._queue: deque[tuple[Position, bool]] = deque()
        self._last: bool | None = None

    @property
    def sampler(self) -> GlobalBatches:
        # Lightning calls ``set_epoch`` on ``loader.sampler`` at every epoch start
        # (lightning.fabric.utilities.data._set_sampler_epoch); the stream takes it there.
        return self.batches

    def __iter__(self) -> Iterator[Batch]:
        self._queue = deque()
        for batch, position, last in self.batches.batches(self._trained):
            self._queue.append((position, last))
            yield {key: value.pin_memory() for key, value in batch.items()} if self.pin_memory else batch

    def __len__(self) -> int:
        # The whole epoch, also when resumed in its middle: Lightning counts a resumed epoch's
        # batches from where it stopped (batch_progress) and ends the epoch when that count
        # reaches this length; the rest of the epoch alone would end it early (case C07).
        return self.batches.num_batches(self._trained)

    def mark_trained(self) -> dict[str, float]:
        """Advances the trained position by the oldest handed-out batch; returns the stream's
        metrics at the new position."""
        self._trained, self._last = self._queue.popleft()
        return self.batches.metrics(self._trained)

    @property
    def exhausted(self) -> bool:
        """True once the trained position has reached the end of finite data."""
        if self._last is None:
            self._last = self.batches.exhausted(self._trained)
        return self._last

    def state_dict(self) -> Position:
        return copy.deepcopy(self._trained)

    def load_state_dict(self, state: Position) -> None:
        self._trained = self.batches.restore(copy.deepcopy(state))
        self._queue, self._last = deque(), None


class RowBatches:
    """Global batches of fixed rows in a `GlobalBatchSampler`'s order (see module docstring).

    Args:
        rows: key -> ``[N, ...]`` tensor; a batch holds each key's rows at the sampler's indices
            (read when the batch is made: a column filled later, like reference log-probs, is seen).
        sampler: the order; its epoch is set by Lightning (`set_epoch`) and by `restore`.
        balancer: orders each global batch's rows over dp ranks and micro-batches by their
            estimated work (`trainer.data.balance`; reads ``rows["document_ids"]``); None keeps
            the sampler's order.
    """

    def __init__(self, rows: dict[str, Tensor], sampler: GlobalBatchSampler, balancer: Balancer | None = None) -> None:
        self.rows, self.sampler, self.balancer = rows, sampler, balancer

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def start(self) -> Position:
        return {"epoch": self.sampler.epoch, "trained": 0}

    def batches(self, position: Position) -> Iterator[tuple[Batch, Position, bool]]:
        epoch = self.sampler.epoch
        first = (
            position["trained"]
            if position["epoch"] == epoch and position["trained"] < self.sampler.num_batches()
            else 0
        )
        for k, indices in enumerate(self._indices(first), start=first + 1):
            yield {key: value[indices] for key, value in self.rows.items()}, {"epoch": epoch, "trained": k}, False

    def _indices(self, first: int) -> Iterator[Any]:
        if self.balancer is None:
            yield from self.sampler.iter_from(first)
            return
        for rows in self.sampler.global_from(first):
            order = self.balancer.order(self.rows["document_ids"][rows], self.sampler.dp_size)
            yield self.sampler.local(rows[order])

    def num_batches(self, position: Position) -> int:
        return self.sampler.num_batches()

    def restore(self, state: Position) -> Position:
        epoch, trained = state["epoch"], state["trained"]
        if trained >= self.sampler.num_batches():
            # Saved after the last batch of an epoch: resume at the start of the next one. An empty
            # rest of the epoch would make the loader's length 0, and Lightning ends the fit on a
            # zero-length loader ("No training batches") instead of starting the next epoch (C09).
            epoch, trained = epoch + 1, 0
        self.sampler.set_epoch(epoch)
        return {"epoch": epoch, "trained": trained}

    def exhausted(self, position: Position) -> bool:
        return False  # epochs repeat until trainer.max_steps

    def metrics(self, position: Position) -> dict[str, float]:
        return {}


def supervised_per_source(rows: list[list[Piece]], num_sources: int) -> list[int]:
    counts = [0] * num_sources
    for pieces in rows:
        for source, _, labs in pieces:
            counts[source] += int((labs != IGNORE_INDEX).sum())
    return counts


class PackedBatches:
    """Global batches packed on the fly from a mixture; one pass over it is the run.

    The last global batch is completed with padding rows (no target), so every supervised token
    of every budget is trained.

    Args:
        make_packer: a fresh packer at the start of the mixture.
        names: source names, in source-index order.
        global_batch_size: rows per optimizer step over all dp ranks.
        dp_rank, dp_size: this rank on the data-parallel axis.
        dropped: supervised tokens per source that the long-sample policy cut before packing
            (logged with the consumed tokens as ``train/dropped_tokens/<source>``).
        balancer: orders each global batch's rows over dp ranks and micro-batches by their
            estimated work (`trainer.data.balance`); None keeps the packing order.

    Raises:
        ValueError: ``global_batch_size`` is not a positive multiple of ``dp_size``.
    """

    def __init__(
        self,
        make_packer: Callable[[], Packer],
        *,
        names: list[str],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        dropped: dict[str, int] | None = None,
        balancer: Balancer | None = None,
    ) -> None:
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of dp={dp_size}")
        self.make_packer, self.names = make_packer, list(names)
        self.dropped = dict(dropped or {})
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.balancer = balancer
        self._length: int | None = None

    def _packer(self, position: Position) -> Packer:
        packer = self.make_packer()
        packer.load_state_dict(position["packer"])
        return packer

    def start(self) -> Position:
        return {"packer": self.make_packer().state_dict(), "batches": 0, "tokens": dict.fromkeys(self.names, 0)}

    def batches(self, position: Position) -> Iterator[tuple[Batch, Position, bool]]:
        packer = self._packer(position)
        done, tokens = position["batches"], dict(position["tokens"])
        while True:
            rows = []
            while len(rows) < self.global_batch_size and (row := packer.next_row()) is not None:
                rows.append(row)
            if not rows:
                return
            for name, n in zip(self.names, supervised_per_source(rows, len(self.names))):
                tokens[name] += n
            done, last = done + 1, packer.exhausted()
            after = {"packer": packer.state_dict(), "batches": done, "tokens": dict(tokens)}
            yield self._local(rows, packer), after, last
            if last:
                return

    def _local(self, rows: list[list[Piece]], packer: Packer) -> Batch:
        """This rank's rows of a global batch (completed with padding rows), as tensors."""
        local = self.global_batch_size // self.dp_size
        if self.balancer is None:
            mine = rows[self.dp_rank * local : (self.dp_rank + 1) * local]
            return rows_to_tensors(mine, num_rows=local, seq_len=packer.seq_len, pad_id=packer.pad_id)
        batch = rows_to_tensors(rows, num_rows=self.global_batch_size, seq_len=packer.seq_len, pad_id=packer.pad_id)
        order = self.balancer.order(batch["document_ids"], self.dp_size)[
            self.dp_rank * local : (self.dp_rank + 1) * local
        ]
        return {key: value[order] for key, value in batch.items()}

    def num_batches(self, position: Position) -> int:
        """Global batches trained before ``position`` plus those left from it (the whole pass)."""
        if self._length is None:
            packer, rows = self._packer(position), 0
            while packer.next_row() is not None:
                rows += 1
            self._length = position["batches"] + -(-rows // self.global_batch_size)
        return self._length

    def restore(self, state: Position) -> Position:
        for name in self.names:  # a source added since the checkpoint starts at 0
            state["tokens"].setdefault(name, 0)
        self._length = None
        return state

    def exhausted(self, position: Position) -> bool:
        return self._packer(position).exhausted()

    def metrics(self, position: Position) -> dict[str, float]:
        metrics = {f"train/consumed_tokens/{name}": float(n) for name, n in position["tokens"].items()}
        return metrics | {f"train/dropped_tokens/{name}": float(n) for name, n in self.dropped.items()}


def shard_rows(rows: dict[str, Tensor], *, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[Batch]:
    """This dp rank's contiguous share of ``rows`` in micro-batches, for evaluation.

    Every row is evaluated exactly once on some rank, whatever dp: the shares differ by at most
    one row (the first ranks hold one more), and every rank runs the same number of forward
    passes (FSDP gathers parameters in each one). A rank without any row (fewer rows than ranks)
    evaluates a copy of the first row whose labels are all -100 (zero supervised tokens: it adds
    nothing to a token-weighted loss, and pair objectives count it as no pair,
    `trainer.objectives.preference.held_pairs`).

    Args:
        rows: key -> ``[N, ...]`` tensor.
        dp_rank, dp_size: this rank on the data-parallel axis.
        micro_batch_size: rows per forward (at most).
    """
    num = next(iter(rows.values())).shape[0] if rows else 0
    if num == 0:
        return []
    share = -(-num // dp_size)  # the largest share
    step = max(1, min(share, micro_batch_size))
    forwards = -(-share // step)
    indices = torch.tensor_split(torch.arange(num), dp_size)[dp_rank]
    if len(indices) == 0:
        pad = {k: torch.full_like(v[:1], IGNORE_INDEX) if "labels" in k else v[:1] for k, v in rows.items()}
        return [pad] * forwards
    if len(indices) > step * (forwards - 1):  # full micro-batches, the rest last (as dp = 1 would)
        parts = [indices[i : i + step] for i in range(0, len(indices), step)]
    else:  # one row fewer than the largest share: spread it over the same number of forwards
        parts = list(torch.tensor_split(indices, forwards))
    return [{k: v[part] for k, v in rows.items()} for part in parts]
