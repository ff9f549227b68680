"""Case C06 — LR scheduler steps per micro-batch instead of per optimizer step
(Lightning-AI/pytorch-lightning#1476).

Scenario: GA=4, linear warmup to a peak of 1e-3 over 16 optimizer steps, 64 micro-batches.
Expected: optimizer step k trains at 1e-3 * k / 16 (torchtitan's warmup: step 1 at 1/16 of the peak,
not at 0), so the LR after step k is 1e-3 * min(k + 1, 16) / 16: k=1 -> 1.25e-4, k=4 -> 3.125e-4,
k=15, 16 -> 1e-3. After the 64 micro-batches, scheduler.last_epoch == global_step == 16. The fault gives
3.125e-4 after the first optimizer step and reaches the peak after 4.

A real fit of the nano pretraining recipe on one process: global batch 4, micro-batch 1 (GA=4),
16 steps, ``scheduler=constant scheduler.warmup_steps=16`` (linear warmup, then constant).
The history's "lr" is the LR *used* by step k, i.e. the LR after step k-1; the callback below
reads the LR after each step, once the Task has stepped the scheduler.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from harness import compose_config, fit
from typing_extensions import override

PEAK, WARMUP, GA = 1e-3, 16, 4


class LrAfterStep(L.Callback):
    """Appends the LR after each optimizer step, training forwards so far, and at the end the
    scheduler's ``last_epoch`` next to ``global_step``."""

    def __init__(self) -> None:
        self.forwards = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        def count(module: Any, args: Any) -> None:
            self.forwards += module.training

        pl_module.model.register_forward_pre_hook(count)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        pl_module.history.append({"step": trainer.global_step, "lr_after": lr, "forwards": self.forwards})

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        (config,) = trainer.lr_scheduler_configs
        pl_module.history.append({"last_epoch": config.scheduler.last_epoch, "global_step": trainer.global_step})


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    cfg = compose_config(
        [
            "train.global_batch_size=4",
            "train.micro_batch_size=1",
            "optim.lr=1e-3",
            "scheduler=constant",
            f"scheduler.warmup_steps={WARMUP}",
            "trainer.max_steps=16",
            "+callbacks.lr._target_=test_c06_scheduler_per_optimizer_step.LrAfterStep",
        ]
    )
    _, task = fit(cfg, tmp_path_factory.mktemp("c06"))
    return task.history


def test_lr_after_optimizer_steps(history):
    after = {h["step"]: h["lr_after"] for h in history if "lr_after" in h}
    assert sorted(after) == list(range(1, 17))
    assert after[1] == pytest.approx(1.25e-4, rel=1e-9)
    assert after[4] == pytest.approx(3.125e-4, rel=1e-9)
    assert after[16] == pytest.approx(1e-3, rel=1e-9)
    assert [after[k] for k in range(1, 17)] == pytest.approx(
        [PEAK * min(k + 1, WARMUP) / WARMUP for k in range(1, 17)], rel=1e-9
    )


def test_lr_used_by_each_step_is_the_one_after_the_previous_step(history):
    used = [h["lr"] for h in history if "loss" in h]
    assert used == pytest.approx([PEAK * k / WARMUP for k in range(1, 17)], rel=1e-9, abs=1e-15)


def test_scheduler_steps_once_per_optimizer_step(history):
    forwards = [h["forwards"] for h in history if "forwards" in h]
    assert forwards == [GA * k for k in range(1, 17)]  # 64 micro-batches in all
    (end,) = [h for h in history if "last_epoch" in h]
    assert end["last_epoch"] == end["global_step"] == 16
