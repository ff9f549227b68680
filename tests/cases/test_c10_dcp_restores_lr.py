"""Case C10 — DCP load keeps tensor state but drops the optimizer's learning rate
(pytorch/pytorch#129079, fixed by #129398; related #140900 on ``initial_lr``).

Scenario: one parameter, SGD(lr=0.1) + StepLR(step_size=1, gamma=0.5) stepped 3 times, so the LR
is 0.0125. Save with plait's `strategies.checkpoint.dcp.save`; build a fresh optimizer (lr=0.1) and
scheduler; load with `strategies.checkpoint.dcp.load`.
Expected: param_groups[0]['lr'] == 0.0125 and initial_lr == 0.1 (needed to rebuild the scheduler);
the next two updates use 0.0125 and 0.00625. The bug leaves lr = 0.1, an 8x too large first update.
Also through a real plait fit: the LR of every step after a resume equals the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any

import torch
from harness import compose_config, fit
from torch import nn

from strategies.checkpoint import dcp as ckpt


class OneParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0]))


def sgd_step_lr(model: nn.Module) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.StepLR]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def update(model: OneParameter, optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    """One step on loss = w (gradient 1, no momentum): returns the size of the update, i.e. the LR used."""
    before = model.w.item()
    model.w.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return before - model.w.item()


def test_dcp_checkpoint_restores_lr_and_initial_lr(tmp_path) -> None:
    model = OneParameter()
    optimizer, scheduler = sgd_step_lr(model)
    for _ in range(3):
        update(model, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == 0.0125
    ckpt.save(tmp_path / "step_3", model=model, optimizers=[optimizer], meta={"scheduler": scheduler.state_dict()})

    fresh = OneParameter()
    fresh_optimizer, fresh_scheduler = sgd_step_lr(fresh)  # lr=0.1, as a resumed run builds them
    meta = ckpt.load(tmp_path / "step_3", model=fresh, optimizers=[fresh_optimizer])
    fresh_scheduler.load_state_dict(meta["scheduler"])  # what Lightning does with the saved meta

    group = fresh_optimizer.param_groups[0]
    assert group["lr"] == 0.0125  # the bug: 0.1
    assert group["initial_lr"] == 0.1
    assert fresh.w.item() == model.w.item()
    used = [update(fresh, fresh_optimizer, fresh_scheduler) for _ in range(2)]
    torch.testing.assert_close(used, [0.0125, 0.00625], rtol=0, atol=1e-7)


def test_lr_after_a_plait_resume_equals_the_uninterrupted_run(tmp_path) -> None:
    run = (
        "strategy=ddp",
        "trainer.devices=1",
        "optim=sgd",
        "scheduler=cosine",
        "scheduler.warmup_steps=5",  # the LR changes at every one of the 4 steps (1/5 .. 4/5 of the peak)
        "trainer.max_steps=4",
        "callbacks.checkpoint.every_n_steps=2",
    )
    _, reference = fit(compose_config(run), tmp_path / "full")
    _, resumed = fit(
        compose_config(run), tmp_path / "resumed", ckpt_path=str(tmp_path / "full" / "checkpoints" / "step_0000002")
    )

    def lrs(history: list[dict[str, Any]]) -> dict[int, float]:
        return {h["step"]: h["lr"] for h in history if "lr" in h}

    expected = lrs(reference.history)
    assert len(set(expected.values())) == 4  # a distinct LR per step, so a fresh or stale one shows
    assert lrs(resumed.history) == expected
    losses = {h["step"]: h["loss"] for h in resumed.history if "loss" in h}
    assert abs(losses[3] - {h["step"]: h["loss"] for h in reference.history if "loss" in h}[3]) <= 1e-6
