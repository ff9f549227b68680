"""`plait pretrain strategy=cp` end to end: two ranks split every row's sequence (ring attention),
train, evaluate and write a DCP checkpoint (parameters FSDP-sharded over the cp ranks).

The literal long-context command of the README, ``plait pretrain strategy=cp strategy.cp_mode=ring
trainer.devices=2 data.seq_len=4096``, runs the same path with the default tiny model (max_seq_len
4096); it takes minutes per step on 2 CPU cores, so this test uses the CLI's tiny settings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_run(tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    result = plait("pretrain", *CLI_TINY, "strategy=cp", f"strategy.cp_mode={mode}", "trainer.devices=2", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(math.isfinite(float(row["train/loss"])) for row in rows.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == 4 * 8 * 64  # every token of the global batch counted once, not per cp rank
    assert (run_dir / "checkpoints" / "step_0000004").is_dir()
