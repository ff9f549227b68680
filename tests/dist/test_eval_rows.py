"""Every layout evaluates every validation row exactly once: the validation loss does not depend on
the number of data-parallel ranks, also when it does not divide the rows.

Before this, the rows were trimmed to a multiple of dp (5 rows on 2 ranks evaluated 4), so
val/loss (and summary.json) changed with the world size on the same data.
"""

from __future__ import annotations

import pytest
import torch

from harness import EXACT_SGD, compose_config, fit
from trainer.data.loader import shard_rows
from trainer.data.packing import IGNORE_INDEX


@pytest.mark.parametrize("num", range(0, 11))
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_shard_rows_covers_every_row_once_with_equal_forward_counts(num: int, dp: int) -> None:
    rows = {"input_ids": torch.arange(num)[:, None].repeat(1, 3), "labels": torch.arange(num)[:, None].repeat(1, 3)}
    shards = [shard_rows(rows, dp_rank=r, dp_size=dp, micro_batch_size=2) for r in range(dp)]
    assert len({len(s) for s in shards}) == 1  # FSDP: the same number of forwards on every rank
    labels = [b["labels"] for s in shards for b in s]
    assert all(0 < len(b) <= 2 for b in labels)
    evaluated = torch.cat(labels)[:, 0] if labels else torch.zeros(0)
    assert sorted(evaluated[evaluated != IGNORE_INDEX].tolist()) == list(range(num))


def _val_loss(rows: int, devices: int, tmp_path) -> float:
    cfg = compose_config(
        [*EXACT_SGD, "strategy=fsdp", f"trainer.devices={devices}", "train.global_batch_size=6",
         "train.micro_batch_size=null", f"data.eval_rows={rows}", "trainer.max_steps=1", "~callbacks.checkpoint"]
    )
    run_dir = tmp_path / f"rows{rows}_devices{devices}"
    run_dir.mkdir()
    _, task = fit(cfg, run_dir)
    return next(h["val_loss"] for h in task.history if "val_loss" in h)  # before the first step


@pytest.mark.parametrize("rows", [5, 7])
def test_validation_loss_is_the_same_on_1_2_and_3_processes(rows: int, tmp_path) -> None:
    one, two, three = (_val_loss(rows, d, tmp_path) for d in (1, 2, 3))
    assert two == pytest.approx(one, rel=1e-6, abs=1e-6)
    assert three == pytest.approx(one, rel=1e-6, abs=1e-6)
