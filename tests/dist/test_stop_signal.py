"""SIGTERM reaching one rank of a 2-process run: every rank saves the same step and exits 143."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from harness import compose_config, fit

from strategies.checkpoint.dcp import verify_checkpoint
from trainer.rundir import RunDir, step_dirs

SIGNALLED = 2  # rank 0 receives SIGTERM at the start of this optimizer step


class SignalRankZero(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step + 1 == SIGNALLED:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_on_one_rank_saves_on_every_rank_and_exits_143(tmp_path: Path) -> None:
    cfg = compose_config([
        "strategy=fsdp", "trainer.devices=2", "trainer.max_steps=20", "callbacks.checkpoint.every_n_steps=0",
        "+callbacks.signal._target_=test_stop_signal.SignalRankZero",
    ])  # fmt: skip
    with pytest.raises(Exception, match="143") as raised:
        fit(cfg, tmp_path)
    saved = step_dirs(RunDir(tmp_path).checkpoints)
    # The signal came before step 2's flags were reduced (callbacks start steps before checkpoint
    # callbacks): both ranks stop after step 2, both in the one checkpoint.
    assert [p.name for p in saved] == ["step_0000002"], (saved, raised.value)
    assert verify_checkpoint(saved[0]) is None
