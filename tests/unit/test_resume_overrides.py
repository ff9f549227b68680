"""A resume's overridden optimizer values take effect from its first step
(`trainer.resume_record.apply_overrides`), in the groups each value sets; the checks of a resume
against its checkpoint's record are tests/unit/test_resume_consistency.py."""

from __future__ import annotations

import pytest
import torch

from trainer.optim import WarmupDecayLR, lr_factor
from trainer.resume_record import apply_overrides


def test_a_new_lr_takes_effect_from_the_next_step() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 2))
    bias = torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [param], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = WarmupDecayLR(optimizer, total_steps=100, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    for _ in range(30):  # the restored state of a run at step 30
        optimizer.step()
        scheduler.step()
    values = {"optim.lr": 1e-3, "optim.weight_decay": 0.05, "optim.betas": [0.8, 0.9]}
    apply_overrides(optimizer, scheduler, values, {"lr": 1e-3, "weight_decay": 0.05, "betas": [0.8, 0.9]})
    expected = 1e-3 * lr_factor(30, warmup_steps=10, total_steps=100, decay="cosine", min_lr_ratio=0.1)
    assert [g["lr"] for g in optimizer.param_groups] == [expected, expected]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]  # the no-decay group stays 0
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    scheduler.step()
    nxt = 1e-3 * lr_factor(31, warmup_steps=10, total_steps=100, decay="cosine", min_lr_ratio=0.1)
    assert optimizer.param_groups[0]["lr"] == nxt


def test_muon_adamw_groups_follow_their_own_lr_on_a_resume() -> None:
    """Muon's AdamW groups (embedding, LM head, norms) take optim.adamw_lr when it is set: a resume's
    lower optim.lr (what the divergence message advises) left them at it 3.3x higher before, and an
    override of optim.adamw_lr was announced but never applied. Mutation: apply_overrides writing optim.lr
    into every group fails the first assertion; ignoring the optimizer's lr_key fails the second."""
    from strategies.muon import Muon

    weight, emb = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(8, 4))
    groups = [{"params": [weight, emb], "param_names": ["layers.0.w", "tok_embeddings.weight"], "weight_decay": 0.1}]

    def resumed(values: dict, optim: dict) -> list[float]:
        optimizer = Muon(groups, lr=0.02, adamw_lr=3e-3)
        scheduler = WarmupDecayLR(optimizer, total_steps=100, warmup_steps=0, decay="cosine", min_lr_ratio=0.1)
        for _ in range(30):
            scheduler.step()
        apply_overrides(optimizer, scheduler, values, optim)
        factor = lr_factor(30, warmup_steps=0, total_steps=100, decay="cosine", min_lr_ratio=0.1)
        assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]
        return [g["lr"] / factor for g in optimizer.param_groups]

    assert resumed({"optim.lr": 0.01}, {"lr": 0.01, "adamw_lr": 3e-3}) == pytest.approx([0.01, 3e-3])
    assert resumed({"optim.adamw_lr": 1e-3}, {"lr": 0.02, "adamw_lr": 1e-3}) == pytest.approx([0.02, 1e-3])
    assert resumed({"optim.adamw_lr": None}, {"lr": 0.02, "adamw_lr": None}) == pytest.approx([0.02, 0.02])


def test_muon_param_groups_keep_the_keys_older_checkpoints_hold() -> None:
    """DCP loads every key of the new optimizer's groups from a checkpoint's flattened state: a key
    added to Muon's groups (an lr_key, for one) made every Muon checkpoint written before it refuse its
    resume ('Missing key in checkpoint state_dict: optimizer_0.param_groups.output.weight.lr_key').
    A new key needs a load that fills it for older checkpoints."""
    from strategies.muon import Muon

    weight, emb = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(8, 4))
    groups = [{"params": [weight, emb], "param_names": ["layers.0.w", "tok_embeddings.weight"], "weight_decay": 0.1}]
    keys = {"betas", "eps", "lr", "momentum", "nesterov", "ns_dtype", "ns_steps", "params", "scale", "use_muon"}
    for group in Muon(groups, lr=0.02, adamw_lr=3e-3).param_groups:
        assert set(group) == keys | {"weight_decay"}
