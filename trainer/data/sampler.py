"""Global-batch sampling that does not depend on the world size, and a loader that resumes exactly.

Each optimizer step consumes one *global* batch: ``global_batch_size`` rows chosen by an epoch
permutation that depends only on (seed, epoch). Data-parallel rank r takes the r-th contiguous
slice. So the same run at another world size, or resumed at another layout, sees the same rows
in the same steps (DESIGN section 5).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this dp rank's row indices of global batches ``start, start+1, ...`` of one epoch.

    Args:
        num_rows: rows in the dataset.
        global_batch_size: rows per optimizer step over all dp ranks.
        dp_rank, dp_size: this rank's position on the dp axis and its size.
        shuffle: permute rows with a generator seeded by (seed, epoch).
        seed: base seed of the permutation.
        drop_last: drop the final partial global batch. When kept, it is trimmed to a multiple of
            dp_size rows so every rank gets the same number (and dropped if that is zero).

    Raises:
        ValueError: global_batch_size is not a positive multiple of dp_size.
    """

    def __init__(
        self,
        num_rows: int,
        *,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of dp={dp_size}")
        self.num_rows, self.global_batch_size = num_rows, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0  # first global batch of the next iteration; set when resuming mid-epoch

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch (through `sampler`)."""
        self.epoch = epoch

    @property
    def sampler(self) -> GlobalBatchSampler:
        # Lightning sets the epoch on ``loader.sampler`` and ``loader.batch_sampler.sampler`` only
        # (lightning.fabric.utilities.data._set_sampler_epoch). A batch sampler without an inner
        # sampler must stand there itself, or every epoch repeats the first epoch's order.
        return self

    def num_batches(self) -> int:
        """Global batches in one epoch."""
        full, rest = divmod(self.num_rows, self.global_batch_size)
        return full + int(not self.drop_last and rest >= self.dp_size)

    def __len__(self) -> int:
        return self.num_batches() - self.start

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        start, self.start = self.start, 0
        for k in range(start, self.num_batches()):
            rows = order[k * self.global_batch_size : (k + 1) * self.global_batch_size]
            local = len(rows) // self.dp_size
            yield rows[self.dp_rank * local : (self.dp_rank + 1) * local].tolist()


class StatefulLoader(DataLoader):
    """A DataLoader over a `GlobalBatchSampler` whose state is the position *trained*, not handed out.

    Lightning prefetches a batch ahead, so counting batches yielded would resume one batch late.
    The Task calls `mark_trained` once per optimizer step; Lightning saves `state_dict` in every
    checkpoint and calls `load_state_dict` on resume (it detects the two methods).
    """

    def __init__(self, dataset: Dataset, sampler: GlobalBatchSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.global_sampler = sampler
        self.trained = 0  # global batches of the current epoch trained on

    def __iter__(self) -> Iterator[Any]:
        self.trained = self.global_sampler.start
        return super().__iter__()

    def __len__(self) -> int:
        # The whole epoch, also when resumed in its middle: Lightning counts a resumed epoch's
        # batches from where it stopped (batch_progress), and ends the epoch when that count
        # reaches this length; the rest of the epoch alone would end it early (case C07).
        return self.global_sampler.num_batches()

    def mark_trained(self) -> None:
        self.trained += 1

    @property
    def exhausted(self) -> bool:
        """Never: epochs repeat until ``trainer.max_steps``."""
        return False

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.global_sampler.epoch, "trained": self.trained}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, trained = state["epoch"], state["trained"]
        if trained >= self.global_sampler.num_batches():
            # Saved after the last batch of an epoch: resume at the start of the next one. An empty
            # rest of the epoch would make the loader's length 0, and Lightning ends the fit on a
            # zero-length loader ("No training batches") instead of starting the next epoch (C09).
            epoch, trained = epoch + 1, 0
        self.global_sampler.set_epoch(epoch)
        self.global_sampler.start = self.trained = trained
