"""Global-batch sampling that does not depend on the world size.

Each optimizer step consumes one *global* batch: ``global_batch_size`` rows chosen by an epoch
permutation that depends only on (seed, epoch). Data-parallel rank r takes the r-th contiguous
slice. So the same run at another world size, or resumed at another layout, sees the same rows
in the same steps (DESIGN section 5). The one exception is the last, partial batch of an epoch
kept with ``drop_last=False``: every rank takes the same number of rows, so it is trimmed to a
multiple of dp (launch warns; a resume at another dp is refused, `trainer.resume`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this dp rank's row indices of the global batches of one epoch.

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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def num_batches(self) -> int:
        """Global batches in one epoch."""
        full, rest = divmod(self.num_rows, self.global_batch_size)
        return full + int(not self.drop_last and rest >= self.dp_size)

    def __len__(self) -> int:
        return self.num_batches()

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_rows)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_rows, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[list[int]]:
        """This rank's row indices of global batches ``start, start + 1, ...`` of the epoch."""
        for rows in self.global_from(start):
            yield self.local(rows).tolist()

    def global_from(self, start: int) -> Iterator[torch.Tensor]:
        """``[N]`` row indices of global batches ``start, start + 1, ...`` of the epoch, every
        rank's (N a multiple of dp_size)."""
        order = self._order()
        for k in range(start, self.num_batches()):
            rows = order[k * self.global_batch_size : (k + 1) * self.global_batch_size]
            yield rows[: len(rows) // self.dp_size * self.dp_size]

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global batch's ``rows``."""
        local = len(rows) // self.dp_size
        return rows[self.dp_rank * local : (self.dp_rank + 1) * local]
