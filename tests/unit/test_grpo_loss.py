"""GRPO-family advantages and the clipped policy-ratio loss (`trainer.rl.advantages`,
`trainer.rl.policy_loss`) against an independent reference written here, within 1e-6: per-group
loops for the advantages (``statistics.stdev``, Bessel-corrected, as TRL's ``nanstd``), per-token
loops for the loss with the clip written piecewise (``A >= 0: -A min(w, 1 + eps_high)``,
``A < 0: -A max(w, 1 - eps)``) instead of PPO's ``-min(wA, clip(w)A)``, and the three aggregations
written as TRL's documentation states them. TRL's own code is the second reference
(tests/unit/test_grpo_loss_trl.py).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from trainer.rl.advantages import group_advantages, group_stats
from trainer.rl.policy_loss import AGGREGATIONS, count_units, policy_loss

# ---------------------------------------------------------------------------------------------
# Advantages


def _rewards(groups: int = 5, size: int = 4, seed: int = 0) -> torch.Tensor:
    """Rewards with a group of equal rewards (zero std), a binary group and continuous groups."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * size, generator=g)
    rewards[:size] = 1.0  # every completion right: zero std
    rewards[size : 2 * size] = torch.tensor([1.0, 0.0, 0.0, 1.0])[:size]
    return rewards


def reference_advantages(rewards: list[float], size: int, scale: str, baseline: str) -> list[float]:
    """Per-group loops: the mean or leave-one-out baseline, divided by (stdev + 1e-4) for "group"."""
    out = []
    for start in range(0, len(rewards), size):
        group = rewards[start : start + size]
        std = statistics.stdev(group)  # Bessel-corrected: TRL's nanstd
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            base = sum(others) / len(others) if baseline == "leave_one_out" else sum(group) / len(group)
            out.append((r - base) / (std + 1e-4) if scale == "group" else r - base)
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_advantages_equal_per_group_loops(scale, baseline):
    """GRPO (group, mean), Dr. GRPO (none, mean), RLOO (none, leave_one_out) and RLOO scaled.
    Mutation: the std without Bessel's correction (``n`` in place of ``n - 1``) fails "group"."""
    rewards = _rewards()
    got = group_advantages(rewards, 4, scale=scale, baseline=baseline)
    want = torch.tensor(reference_advantages(rewards.tolist(), 4, scale, baseline))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[:4].abs().max() == 0  # the zero-std group carries no signal in every variant


def test_group_stats_sums():
    """Mutation: counting zero-std groups per row (``N`` units) instead of per group fails it."""
    rewards = _rewards(groups=5, size=4)
    rewards[16:] = 0.5  # a second all-equal group
    stats = group_stats(rewards, 4)
    assert {k: v.item() for k, v in stats.items() if k.startswith("num_")} == {
        "num_rows": 20.0,
        "num_groups": 5.0,
        "num_zero_std_groups": 2.0,
    }
    assert stats["reward_sum"].item() == pytest.approx(rewards.sum().item(), abs=1e-6)
    assert stats["reward_sq_sum"].item() == pytest.approx((rewards**2).sum().item(), abs=1e-5)


def test_group_advantages_refuse_bad_layouts():
    """Mutation: dropping the divisibility check lets ``view`` raise a RuntimeError instead."""
    with pytest.raises(ValueError, match="10 rewards are not a whole number of groups of group_size=4"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="leave_one_out' needs group_size >= 2"):
        group_advantages(torch.zeros(6), 1, baseline="leave_one_out")
    with pytest.raises(ValueError, match="scale='batch'"):
        group_advantages(torch.zeros(8), 4, scale="batch")
    with pytest.raises(ValueError, match="must be 1-D"):
        group_advantages(torch.zeros(2, 4), 4)
    # G = 1: TRL's std is 0 (eval with num_generations_eval=1), the advantage 0, never NaN.
    assert group_advantages(torch.arange(3.0), 1).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# The policy loss

ROW_LENGTHS = (7, 3, 5, 1, 6, 0, 4, 2)  # row 5 has no completion tokens
# logps - old_logps per row (+-0.1 noise per token), with advantages whose signs put rows 0 and 7
# above 1 + eps_high with A > 0 (high clip), rows 1 and 6 below 1 - eps with A < 0 (low clip),
# and rows 2 and 3 outside the range on the side where the clip does not bind.
ROW_SHIFTS = (0.4, -0.4, 0.35, -0.3, 0.0, 0.1, -0.35, 0.38)
ADVANTAGES = (1.2, -0.7, -1.1, 0.9, 0.0, 0.5, -0.6, 1.3)
MAX_COMPLETION_LENGTH = 9


def _batch(seed: int = 0, garbage: str = "nonfinite"):
    """logps, old_logps, ref_logps ``[8, 7]``, advantages ``[8]``, mask with a gap in row 0.

    ``garbage``: what fills the positions outside the mask ("nonfinite": -inf, NaN and +inf;
    "finite": large finite values, for TRL, which multiplies by the mask).
    """
    g = torch.Generator().manual_seed(seed)
    rows, width = len(ROW_LENGTHS), max(ROW_LENGTHS)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(ROW_LENGTHS).unsqueeze(1)
    mask[0, 2] = False  # a masked token inside a completion (a tool's output)
    logps = -torch.rand(rows, width, generator=g) * 3 - 0.05
    noise = (torch.rand(rows, width, generator=g) - 0.5) * 0.2
    old = logps - torch.tensor(ROW_SHIFTS).unsqueeze(1) - noise
    ref = logps + (torch.rand(rows, width, generator=g) - 0.5)
    if garbage == "nonfinite":
        logps, old, ref = (
            logps.masked_fill(~mask, -math.inf),
            old.masked_fill(~mask, math.nan),
            ref.masked_fill(~mask, math.inf),
        )
    else:
        logps, old, ref = logps.masked_fill(~mask, -40.0), old.masked_fill(~mask, 3.0), ref.masked_fill(~mask, -7.0)
    return logps, old, ref, torch.tensor(ADVANTAGES), mask


def reference_loss(logps, old, ref, adv, mask, *, eps, eps_high, importance, beta, aggregation, max_len):
    """The loss written token by token in float64; returns (loss, low-clipped count, high-clipped count).

    ``logps`` is a float64 leaf; only masked-in positions are ever read."""
    eps_high = eps if eps_high is None else eps_high
    rows, width = mask.shape
    row_losses, low, high = [], 0, 0
    for i in range(rows):
        tokens = [t for t in range(width) if mask[i, t]]
        seq_log_ratio = sum((logps[i, t] - old[i, t] for t in tokens), torch.zeros((), dtype=torch.float64))
        seq_log_ratio = seq_log_ratio / max(len(tokens), 1)
        terms = []
        for t in tokens:
            w = torch.exp(seq_log_ratio if importance == "sequence" else logps[i, t] - old[i, t])
            a = adv[i].item()
            if a >= 0:
                term = -a * (w if w.item() <= 1 + eps_high else torch.tensor(1 + eps_high, dtype=torch.float64))
                high += a > 0 and w.item() > 1 + eps_high
            else:
                term = -a * (w if w.item() >= 1 - eps else torch.tensor(1 - eps, dtype=torch.float64))
                low += w.item() < 1 - eps
            if beta:
                d = ref[i, t] - logps[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            terms.append(term)
        row_losses.append(terms)
    token_sum = sum((sum(terms) for terms in row_losses if terms), torch.zeros((), dtype=torch.float64))
    if aggregation == "grpo":  # mean over each row's tokens, then over rows (empty rows count, as 0)
        loss = sum((sum(terms) / len(terms) for terms in row_losses if terms), torch.zeros((), dtype=torch.float64))
        loss = loss / rows
    elif aggregation == "dr_grpo":  # every row as if max_len long
        loss = token_sum / (rows * max_len)
    else:  # dapo: mean over all completion tokens
        loss = token_sum / sum(len(terms) for terms in row_losses)
    return loss, low, high


@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_and_gradient_equal_reference(aggregation, importance, beta, eps_high):
    """Mutations: clipping the high side at ``1 + epsilon`` instead of ``1 + epsilon_high`` fails
    eps_high=0.28; the per-token mean in place of the per-row mean fails grpo; the token log ratios
    summed instead of averaged fails sequence; multiplying by the mask lets NaN through."""
    logps, old, ref, adv, mask = _batch()
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
        ref_logps=ref,
        aggregation=aggregation,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )
    loss = got.loss_sum / count_units(mask, aggregation)
    loss.backward()

    ref_leaf = logps.double().requires_grad_(True)
    want, low, high = reference_loss(
        ref_leaf,
        old.double(),
        ref.double(),
        adv.double(),
        mask,
        eps=0.2,
        eps_high=eps_high,
        importance=importance,
        beta=beta,
        aggregation=aggregation,
        max_len=MAX_COMPLETION_LENGTH,
    )
    want.backward()
    assert low > 0 and high > 0  # both sides of the clip bind somewhere
    torch.testing.assert_close(loss.double(), want.detach(), rtol=0, atol=1e-6)
    want_grad = torch.where(mask, ref_leaf.grad, 0.0).float()  # the reference never reads masked-out positions
    torch.testing.assert_close(leaf.grad, want_grad, rtol=0, atol=1e-6)
    tokens = mask.sum().item()
    assert got.sums["clip_ratio/low"][0].item() == low and got.sums["clip_ratio/high"][0].item() == high
    assert got.sums["clip_ratio/region"][0].item() == low + high
    assert {count.item() for _, count in got.sums.values()} == {tokens}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_positions_change_nothing(aggregation):
    """inf and NaN outside the mask: the same loss and gradient as finite values there, gradient
    exactly 0 there, and 0 everywhere for the row without tokens. Mutation: masking the log ratio
    (or the k3 term) by multiplying with the mask turns 0 * inf into NaN and fails it."""
    results = []
    for garbage in ("nonfinite", "finite"):
        logps, old, ref, adv, mask = _batch(seed=2, garbage=garbage)
        leaf = logps.clone().requires_grad_(True)
        for importance in ("token", "sequence"):
            out = policy_loss(
                leaf,
                old,
                adv,
                mask,
                importance=importance,
                beta=0.04,
                ref_logps=ref,
                aggregation=aggregation,
                max_completion_length=MAX_COMPLETION_LENGTH,
            )
            out.loss_sum.backward()
            results.append((out.loss_sum.detach(), {k: torch.stack(v) for k, v in out.sums.items()}))
        assert torch.isfinite(leaf.grad).all()
        assert leaf.grad[~mask].abs().max() == 0 and leaf.grad[5].abs().max() == 0
        results.append(leaf.grad)
    half = len(results) // 2
    for nonfinite, finite in zip(results[:half], results[half:]):
        torch.testing.assert_close(nonfinite, finite, rtol=0, atol=0)


def test_on_policy_ratio_is_one():
    """``old_logps=None``: ratio exactly 1, nothing clipped, and the grpo gradient of each token is
    ``-A / (tokens of its row * rows)`` (the policy gradient). Mutation: ``old = logps`` without
    ``detach`` makes the ratio's gradient 0 and fails it."""
    logps, _, _, adv, mask = _batch(seed=3, garbage="finite")
    leaf = logps.clone().requires_grad_(True)
    out = policy_loss(leaf, None, adv, mask, epsilon=0.0)
    (out.loss_sum / count_units(mask, "grpo")).backward()
    tokens = mask.sum().float()
    assert out.sums["ratio"][0].item() == tokens.item() and out.sums["clip_ratio/region"][0].item() == 0
    per_row = mask.sum(-1).clamp(min=1).float()
    want = torch.where(mask, (-adv / per_row / mask.shape[0]).unsqueeze(-1).expand_as(mask), 0.0)
    torch.testing.assert_close(leaf.grad, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_add_up_to_the_batch(aggregation):
    """The Task's contract: summed ``loss_sum`` over micro-batches divided by summed ``count_units``
    is the loss of the whole batch. Mutation: dapo's ``loss_sum`` as the token mean (dividing by
    the micro-batch's own tokens) fails it, since the halves hold different numbers of tokens."""
    logps, old, ref, adv, mask = _batch(seed=4, garbage="finite")
    kwargs = {"beta": 0.04, "epsilon_high": 0.28, "aggregation": aggregation}
    kwargs["max_completion_length"] = MAX_COMPLETION_LENGTH
    whole = policy_loss(logps, old, adv, mask, ref_logps=ref, **kwargs)
    parts = [
        policy_loss(logps[s], old[s], adv[s], mask[s], ref_logps=ref[s], **kwargs) for s in (slice(0, 3), slice(3, 8))
    ]
    units = [count_units(mask[s], aggregation) for s in (slice(0, 3), slice(3, 8))]
    split = sum(p.loss_sum for p in parts) / sum(units)
    torch.testing.assert_close(split, whole.loss_sum / count_units(mask, aggregation), rtol=0, atol=1e-6)


def test_count_units():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    assert [count_units(mask, a).item() for a in AGGREGATIONS] == [3.0, 3.0, 3.0]
    mask[0, 2] = True
    assert [count_units(mask, a).item() for a in AGGREGATIONS] == [3.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="aggregation='bnpo'; use one of"):
        count_units(mask, "bnpo")


def test_policy_loss_refusals_name_the_fix():
    """Every problem at once. Mutation: returning after the first problem fails the joint message."""
    logps, old, _, adv, mask = _batch(garbage="finite")
    with pytest.raises(ValueError) as err:
        policy_loss(logps, old, adv, mask, beta=0.1, aggregation="dr_grpo", epsilon=-0.1)
    message = str(err.value)
    assert "beta=0.1 weighs a KL to the reference: pass ref_logps, or set beta=0" in message
    assert "aggregation='dr_grpo' divides by max_completion_length: pass it" in message
    assert "epsilon=-0.1 must be >= 0" in message
    with pytest.raises(ValueError, match="aggregation='luspo'; use one of"):
        policy_loss(logps, old, adv, mask, aggregation="luspo")
    with pytest.raises(ValueError, match="importance='tokens'; use one of"):
        policy_loss(logps, old, adv, mask, importance="tokens")
    with pytest.raises(ValueError, match="max_completion_length=4 is below a row's 6 completion tokens"):
        policy_loss(logps, old, adv, mask, aggregation="dr_grpo", max_completion_length=4)
    # The width is not the limit: rollout rows hold the prompt and padding too (T = data.seq_len).
    wide = [torch.cat([t, t.new_zeros(len(t), 5)], dim=1) for t in (logps, old, mask)]
    policy_loss(*wide[:2], adv, wide[2], aggregation="dr_grpo", max_completion_length=6)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        policy_loss(logps, old, adv, mask.long())
    with pytest.raises(ValueError, match=r"advantages must be \[R\]"):
        policy_loss(logps, old, adv[:3], mask)


# ---------------------------------------------------------------------------------------------
# Temperature: the loss scores the distribution the completions were sampled from


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_the_loss_scores_the_sampling_distribution(temperature):
    """`GRPO.loss_sum` on rollout rows (on-policy: ratio 1) has the gradient of
    ``-A * log softmax(z / T)[y]`` summed over completion tokens, and its logged entropy is that of
    ``softmax(z / T)`` (TRL divides the logits by the temperature too). `token_logps`, which gives
    the sampling policy's and the reference's log-probs, uses the same tempered distribution.
    Mutation: the plain ``log_softmax(z)`` (what plait did) fails T=0.5 and T=1.7."""
    from torch import nn

    from trainer.objectives.grpo import GRPO
    from trainer.rl.rollout import token_logps

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 2

    class Fixed(nn.Module):  # the logits, whatever the input
        def __init__(self) -> None:
            super().__init__()
            self.z = nn.Parameter(logits.clone())

        def forward(self, input_ids):
            return self.z

    labels = torch.tensor([[-100, 3, 7, 1, -100], [-100, -100, 2, 9, 4]])
    advantages = torch.tensor([0.8, -1.3])
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": labels, "advantages": advantages}
    objective = GRPO(num_generations=2, temperature=temperature, loss_type="dapo")
    model = Fixed()
    objective.loss_sum(model, batch).backward()

    z = logits.double().requires_grad_(True)
    logp = torch.log_softmax(z / temperature, dim=-1)  # the sampled distribution
    loss = z.new_zeros(())
    for row in range(2):
        for t in range(5):
            if labels[row, t] != -100:
                loss = loss - advantages[row].double() * logp[row, t, labels[row, t]]
    loss.backward()
    torch.testing.assert_close(model.z.grad.double(), z.grad, rtol=1e-5, atol=1e-6)

    mask = labels != -100
    probs = logp.detach().exp()
    entropy = -(probs * logp.detach()).sum(-1)[mask].mean()
    total, count = objective._sums["entropy"]
    assert float(total / count) == pytest.approx(float(entropy), rel=1e-5)
    picked = token_logps(logits, labels, temperature)
    want = torch.where(mask, logp.detach().gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(picked.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shift", [0.0, 0.05])
def test_rloo_scores_the_whole_completion_as_one_action(shift):
    """``importance="sequence_sum"`` with the ``grpo`` aggregation (the ``rloo`` preset) against
    RLOO as TRL's ``RLOOTrainer`` writes it, per row in float64: ``ratio = exp(sum logps - sum
    old_logps)``, ``-min(ratio A, clip(ratio) A)``, mean over rows. On policy (shift 0) the gradient of
    a token is ``-A_i / R`` whatever the row's length. Mutation: the mean token log-ratio
    (``sequence``, GSPO) or the per-token ratio weighs each row by ``1 / |y_i|`` and fails it."""
    from omegaconf import OmegaConf

    logps, _, _, adv, mask = _batch(garbage="finite")
    old = torch.where(mask, logps - shift, logps)
    leaf = logps.clone().requires_grad_(True)
    got = policy_loss(leaf, old, adv, mask, epsilon=0.2, importance="sequence_sum", aggregation="grpo")
    (got.loss_sum / count_units(mask, "grpo")).backward()

    ref = logps.double().requires_grad_(True)
    rows = []
    for i in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not tokens:
            rows.append(torch.zeros((), dtype=torch.float64))
            continue
        log_ratio = sum(ref[i, t] - old[i, t].double() for t in tokens)
        ratio, a = torch.exp(log_ratio), adv[i].double()
        rows.append(-torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a))
    want = torch.stack(rows).mean()
    want.backward()
    torch.testing.assert_close(got.loss_sum / count_units(mask, "grpo"), want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    if shift == 0.0:
        expected = torch.where(mask, -adv.double().unsqueeze(-1) / mask.shape[0], 0.0)
        torch.testing.assert_close(leaf.grad.double(), expected, rtol=1e-6, atol=1e-7)
    preset = OmegaConf.load(Path(__file__).parents[2] / "conf" / "objective" / "rloo.yaml")
    assert preset.importance == "sequence_sum" and preset.baseline == "leave_one_out"
