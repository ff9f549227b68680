"""A parallel layout that cannot run stops `plait` before any process starts or any directory is
written, with every problem and the override that fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import plait


@pytest.mark.slow
def test_degrees_that_do_not_multiply_to_the_world_size(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = plait("pretrain", "strategy=nd", "strategy.dp_shard=3", "trainer.devices=2", f"run_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "multiply to 3 but the world size is 2; set trainer.devices" in result.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_tp_and_pp_that_do_not_fit_the_model_are_all_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = plait(
        "pretrain",
        "model=nano",  # 4 heads, 2 kv heads, 2 layers
        "data.seq_len=64",
        "strategy=nd",
        "strategy.dp_shard=1",
        "strategy.tp=4",
        "strategy.pp=3",
        "trainer.devices=12",
        f"run_dir={run_dir}",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "strategy.tp=4 does not divide n_heads=4 and n_kv_heads=2; valid tp: 1, 2" in result.stderr
    assert "strategy.pp=3 stages need at least as many blocks, but the model has 2; use strategy.pp<=2" in result.stderr
    assert not run_dir.exists()
