"""Mixout's mask and mixing (`strategies.transforms.mixout`): unbiased, Bernoulli(p), layout-independent."""

from __future__ import annotations

import pytest
import torch

from strategies.transforms.mixout import global_index, mix_, mixout_mask


def test_monte_carlo_mean_of_mixed_weights_is_the_weight():
    """E[w_mixed] = w: the mean over N steps' masks is within 5 standard errors of w, elementwise."""
    torch.manual_seed(0)
    p, steps = 0.4, 3000
    w, u = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    total = torch.zeros_like(w)
    for step in range(steps):
        mixed = w.clone()
        mix_(mixed, u, mixout_mask(w, p, seed=1, step=step, name="layers.0.w"), p)
        total += mixed
    # Var[w_mixed] = p / (1 - p) (u - w)^2 per element.
    stderr = ((p / (1 - p)) ** 0.5 * (u - w).abs() / steps**0.5).clamp(min=1e-12)
    z = (total / steps - w) / stderr
    assert z.abs().max() < 5.0
    assert z.mean().abs() < 5.0 / 128**0.5


def test_mask_rate_and_independence():
    w = torch.empty(256, 256)
    masks = [mixout_mask(w, 0.1, seed=0, step=s, name="a") for s in range(4)]
    for m in masks:
        assert m.float().mean().item() == pytest.approx(0.1, abs=0.005)
    assert (masks[0] & masks[1]).float().mean().item() == pytest.approx(0.01, abs=0.002)  # steps independent
    other = mixout_mask(w, 0.1, seed=0, step=0, name="b")
    assert (masks[0] & other).float().mean().item() == pytest.approx(0.01, abs=0.002)  # parameters independent
    assert not mixout_mask(w, 0.0, seed=0, step=0, name="a").any()


def test_global_index_of_a_plain_tensor():
    t = torch.empty(3, 4, 5)
    assert torch.equal(global_index(t), torch.arange(60).view(3, 4, 5))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+strategy/sat=default", "strategy=tp", "trainer.devices=2"], "strategy.sat with strategy.tp=2"),
        (["+strategy/sat=default", "strategy.compile.enabled=true"], "strategy.sat with strategy.compile.enabled=true"),
    ],
)
def test_refused_combinations_name_the_fix(overrides, message):
    from harness import compose_config

    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=message.replace("+", r"\+").replace(".", r"\.")):
        validate(compose_config(overrides))


@pytest.mark.parametrize(
    ("overrides", "recipe"), [(["resume=last"], "pretrain"), (["data=synthetic", "budget=msft"], "sft")]
)
def test_mixout_resumes_and_rolls_back(overrides, recipe, tmp_path):
    """Resume and budget=msft (whose roll-backs resume) are accepted: the anchors come back from
    ``model.init_from`` (tests/dist/test_mixout_equivalence.py::test_resume_equals_the_uninterrupted_run)."""
    from harness import compose_config

    from trainer.config import validate

    cfg = compose_config(
        ["+strategy/mixout=default", f"run_dir={tmp_path}", *overrides], recipe=recipe, tiny=recipe == "pretrain"
    )
    validate(cfg)
