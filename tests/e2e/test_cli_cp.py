"""`plait pretrain strategy=cp` end to end: two ranks split every row's sequence (ring attention),
train, evaluate and write a DCP checkpoint (parameters FSDP-sharded over the cp ranks), with the
train and validation losses of a one-process run of the same command (rel 1e-5).

The literal long-context command of the README, ``plait pretrain strategy=cp strategy.context_parallel.mode=ring
trainer.devices=2 data.seq_len=4096``, runs the same path with the default tiny model (max_seq_len
4096); it takes minutes per step on 2 CPU cores, so this test uses the CLI's tiny settings.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

# A constant, larger learning rate than the recipe's warmup: 4 steps move the weights enough that
# a wrong shard (positions, masks, token counts) shows in the losses, not only rounding.
RUN = (*CLI_TINY, "optim.lr=0.01", "scheduler=constant", "scheduler.warmup_steps=0")


def _val_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(file) if r.get("val/loss")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    result = plait("pretrain", *RUN, f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_run(tmp_path: Path, mode: str, one_process: Path) -> None:
    run_dir = tmp_path / "run"
    result = plait(
        "pretrain",
        *RUN,
        "strategy=cp",
        f"strategy.context_parallel.mode={mode}",
        "trainer.devices=2",
        f"run_dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    single = train_rows(one_process)
    for step, row in rows.items():
        assert float(row["train/loss"]) == pytest.approx(float(single[step]["train/loss"]), rel=1e-5), step
    val, single_val = _val_losses(run_dir), _val_losses(one_process)
    assert sorted(val) == sorted(single_val) == [0, 4]
    for step in val:
        assert val[step] == pytest.approx(single_val[step], rel=1e-5), step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == 4 * 8 * 64  # every token of the global batch counted once, not per cp rank
    assert (run_dir / "checkpoints" / "step_0000004").is_dir()
