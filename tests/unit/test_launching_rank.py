"""Only global rank 0 writes the run directory, whoever started the processes (trainer/run.py)."""

from __future__ import annotations

import pytest

from trainer.run import _is_launching_rank

_KEYS = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


@pytest.mark.parametrize(
    ("env", "launching"),
    [
        ({}, True),  # plait alone, before it starts its children
        ({"LOCAL_RANK": "1", "NODE_RANK": "0"}, False),  # a child plait started
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),  # torchrun, node 0
        ({"RANK": "1", "LOCAL_RANK": "0"}, False),  # torchrun, node 1, local rank 0
        ({"SLURM_PROCID": "0"}, True),  # srun task 0 (or an sbatch script without srun)
        ({"SLURM_PROCID": "4"}, False),  # srun task 0 of node 1: LOCAL_RANK is not set yet
    ],
)
def test_only_global_rank_zero_launches(env: dict[str, str], launching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in _KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _is_launching_rank() is launching
