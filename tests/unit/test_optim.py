"""Schedules step per optimizer step with closed-form values; parameter groups split decay."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.optim import WarmupDecayLR, lr_factor, param_groups


def test_warmup_then_cosine_values() -> None:
    kw = dict(warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, **kw) == 0.1  # step 1 trains at 1/warmup of the peak (torchtitan), not at 0
    assert lr_factor(4, **kw) == 0.5
    assert lr_factor(9, **kw) == 1.0
    assert lr_factor(10, **kw) == 1.0
    assert lr_factor(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, **kw) == pytest.approx(0.1)
    assert lr_factor(500, **kw) == pytest.approx(0.1)


def test_linear_and_constant() -> None:
    assert lr_factor(60, warmup_steps=10, total_steps=110, decay="linear", min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(60, warmup_steps=10, total_steps=110, decay="constant", min_lr_ratio=0.0) == 1.0


def test_scheduler_matches_closed_form_and_restores() -> None:
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = WarmupDecayLR(opt, total_steps=20, warmup_steps=4, decay="cosine", min_lr_ratio=0.0)
    lrs = []
    for _ in range(8):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    expected = [
        2.0 * lr_factor(k, warmup_steps=4, total_steps=20, decay="cosine", min_lr_ratio=0.0) for k in range(1, 9)
    ]
    assert lrs == pytest.approx(expected)
    state = sched.state_dict()
    opt2 = torch.optim.SGD([param], lr=2.0)
    sched2 = WarmupDecayLR(opt2, total_steps=20, warmup_steps=4, decay="cosine", min_lr_ratio=0.0)
    sched2.load_state_dict(state)
    sched2.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert not math.isclose(opt.param_groups[0]["lr"], 2.0)


def test_bad_scheduler_arguments() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="scheduler.decay"):
        WarmupDecayLR(opt, total_steps=10, decay="exp")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        WarmupDecayLR(opt, total_steps=10, min_lr_ratio=2.0)


def test_param_groups_split_by_rank_and_name() -> None:
    model = nn.ModuleDict(
        {"tok_embeddings": nn.Embedding(10, 4), "proj": nn.Linear(4, 4, bias=True), "norm": nn.LayerNorm(4)}
    )
    decayed, rest = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in decayed["params"]] == ["proj.weight"]
    assert sorted(names[id(p)] for p in rest["params"]) == [
        "norm.bias",
        "norm.weight",
        "proj.bias",
        "tok_embeddings.weight",
    ]
    assert rest["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.1
    (only,) = param_groups(model, weight_decay=0.1, no_decay=("proj", "tok_embeddings", "norm"))
    assert only["weight_decay"] == 0.0


def test_resume_keeps_the_new_schedule_settings() -> None:
    """Extending trainer.max_steps on resume continues the decay to the new end, not the saved one."""
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    short = WarmupDecayLR(opt, total_steps=10, warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    for _ in range(5):
        opt.step()
        short.step()
    longer = WarmupDecayLR(
        torch.optim.SGD([param], lr=1.0), total_steps=20, warmup_steps=0, decay="linear", min_lr_ratio=0.0
    )
    longer.load_state_dict(short.state_dict())
    assert longer.total_steps == 20 and longer.last_epoch == 5
    assert longer.get_lr()[0] == pytest.approx(0.75)


def test_a_warm_up_longer_than_the_run_is_said_at_launch() -> None:
    """A run of 8 planned steps under the preset's 20 warm-up steps never reaches optim.lr
    (a fresh reviewer: nothing said it); a warm-up shorter than the run says nothing."""
    from omegaconf import OmegaConf

    from trainer.run import warmup_line

    cfg = OmegaConf.create({"scheduler": {"warmup_steps": 20}})
    assert warmup_line(cfg, 8) == (
        "warning: scheduler.warmup_steps=20 is longer than the run's 8 planned steps: the LR is still warming up at "
        "the last step (8/20 of optim.lr); lower scheduler.warmup_steps (e.g. scheduler.warmup_steps=1)"
    )
    assert warmup_line(cfg, 20) is None  # step 20 trains at 20/20: the peak is reached
    assert warmup_line(OmegaConf.create({"scheduler": None}), 3) is None
