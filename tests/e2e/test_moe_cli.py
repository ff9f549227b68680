"""Mixtures of experts from the command line: pretraining under expert parallelism (and LLEP) and
supervised fine-tuning of an MoE run in real subprocesses, and the layouts that cannot run refused
before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import CLI_TINY, plait, train_rows

MOE = ("model=moe_tiny", "model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.max_seq_len=64")


@pytest.mark.slow
@pytest.mark.parametrize("llep", [False, True], ids=["ep2", "llep2"])
def test_pretrain_moe_under_expert_parallelism(tmp_path: Path, llep: bool) -> None:
    extra = (
        ["strategy.expert_parallel.least_loaded=true", "strategy.expert_parallel.min_tokens_per_gemm=1"] if llep else []
    )
    result = plait(
        "pretrain",
        *CLI_TINY,
        *MOE,
        "strategy=nd",
        "trainer.devices=2",
        "strategy.expert_parallel.ep=2",
        *extra,
        f"run_dir={tmp_path}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(tmp_path)
    last = rows[max(rows)]
    assert float(last["train/moe/balance_loss"]) > 0 and "train/moe/load/7" in last
    assert 1.0 <= float(last["ep/max_over_mean_rows"]) <= (1.1 if llep else 2.0)


@pytest.mark.slow
def test_sft_of_an_moe_model(tmp_path: Path) -> None:
    tiny = [o for o in CLI_TINY if not o.startswith("data.")]
    result = plait("sft", *tiny, *MOE, "data.seq_len=64", f"run_dir={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(tmp_path)
    assert "train/moe/load/0" in rows[max(rows)]
