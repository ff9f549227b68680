"""GRPO-family advantages and the clipped policy-ratio loss (`trainer.rl.advantages`,
`trainer.rl.policy_loss`) against TRL's own code, within 1e-6: ``GRPOTrainer._compute_loss``
driven on given log-probs (no model, no generation), ``trl.trainer.utils.nanstd`` in TRL's
advantage lines, and RLOOTrainer's baseline. The independent reference written out by hand is
tests/unit/test_grpo_loss.py, whose batches this file reuses.

TRL is a declared dev dependency (pyproject.toml) and required under CI (tests/conftest.py): it is
imported at module level, so without it this file fails to collect rather than skipping.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from test_grpo_loss import MAX_COMPLETION_LENGTH, _batch, _rewards
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from trainer.rl.advantages import group_advantages, group_stats
from trainer.rl.policy_loss import AGGREGATIONS, count_units, policy_loss


def test_group_advantages_equal_trl_formulas():
    """TRL's lines: GRPOTrainer (sum_then_normalize, scale_rewards group / none) and RLOOTrainer's
    leave-one-out baseline (normalize_advantages=False), with TRL's own ``nanstd``.
    Mutation: leave-one-out dividing by ``G`` instead of ``G - 1`` fails the RLOO comparison."""
    size = 4
    rewards = _rewards(groups=6, size=size, seed=3)
    grouped = rewards.view(-1, size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(size, dim=0)
    std = nanstd(grouped, dim=1).repeat_interleave(size, dim=0)
    trl_grpo = (rewards - mean) / (std + 1e-4)
    trl_dr_grpo = rewards - mean
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    trl_rloo = rewards - ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)

    torch.testing.assert_close(group_advantages(rewards, size), trl_grpo, rtol=0, atol=1e-6)
    torch.testing.assert_close(group_advantages(rewards, size, scale="none"), trl_dr_grpo, rtol=0, atol=1e-6)
    got_rloo = group_advantages(rewards, size, scale="none", baseline="leave_one_out")
    torch.testing.assert_close(got_rloo, trl_rloo, rtol=0, atol=1e-6)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))  # TRL's frac_reward_zero_std, per row
    stats = group_stats(rewards, size)
    assert stats["num_zero_std_groups"].item() == is_std_zero.sum().item() / size == 1


def _trl_loss(logps, old, ref, adv, mask, *, loss_type, importance, beta, eps_high):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on these log-probs, one process, no accumulation.

    Returns (loss, the trainer's _metrics["train"])."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # no __init__: no model, tokenizer or datasets
    rows, width = logps.shape
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = importance
    trainer.epsilon_low, trainer.epsilon_high = 0.2, eps_high
    trainer.beta = beta
    trainer.args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    trainer.off_policy_mask_threshold = None
    trainer.top_entropy_quantile = 1.0
    trainer.use_vllm = False
    trainer._entropy_bonus_enabled = False
    trainer.aux_loss_enabled = False
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.max_completion_length = MAX_COMPLETION_LENGTH
    trainer._metrics = defaultdict(lambda: defaultdict(list))
    entropies = torch.rand(rows, width)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    inputs = {
        "prompt_ids": torch.zeros(rows, 3, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.zeros(rows, width, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        # TRL: the generation batch's completion tokens over all processes (gather(loss_mask.sum()).sum())
        "num_items_in_batch": mask.sum(),
    }
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_equals_trl_compute_loss(aggregation, importance, beta, eps_high):
    """TRL only warns about sequence importance with dr_grpo and dapo (in __init__), so every
    combination runs. Mutations: ``count_units`` for dapo returning rows fails dapo; dr_grpo's
    ``loss_sum`` divided by the completions' width ``T`` instead of ``max_completion_length``
    fails dr_grpo; the k3 estimator written as ``exp(logp - ref) - (logp - ref) - 1`` fails beta>0."""
    logps, old, ref, adv, mask = _batch(seed=1, garbage="finite")
    trl_leaf = logps.clone().requires_grad_(True)
    want, metrics = _trl_loss(
        trl_leaf, old, ref, adv, mask, loss_type=aggregation, importance=importance, beta=beta, eps_high=eps_high
    )
    want.backward()
    leaf = logps.clone().requires_grad_(True)
    got = policy_loss(
        leaf,
        old,
        adv,
        mask,
        epsilon=0.2,
        epsilon_high=eps_high,
        importance=importance,
        beta=beta,
        ref_logps=ref if beta else None,
        aggregation=aggregation,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )
    loss = got.loss_sum / count_units(mask, aggregation)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(leaf.grad, trl_leaf.grad, rtol=0, atol=1e-6)
    assert ("kl" in got.sums) == (beta > 0)
    if beta:
        kl_sum, kl_count = got.sums["kl"]
        assert (kl_sum / kl_count).item() == pytest.approx(metrics["kl"][0], abs=1e-6)
    if importance == "token":  # under "sequence" TRL counts the clip flags once per row, plait per token
        for name in ("low", "high", "region"):
            total, count = got.sums[f"clip_ratio/{name}"]
            assert (total / count).item() == pytest.approx(metrics[f"clip_ratio/{name}_mean"][0], abs=1e-6)
