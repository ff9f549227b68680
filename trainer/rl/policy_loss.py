"""The clipped policy-ratio loss of the GRPO family, as a (sum, count) pair for plait's Task.

Per completion token ``t`` of row ``i`` with advantage ``A_i`` and importance ratio ``w``::

    loss_t = -min(w * A_i, clip(w, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * k3_t

- the clip is PPO's (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7) as
  GRPO uses it (Shao et al. 2024, "DeepSeekMath", eq. 3); ``epsilon_high`` above ``epsilon`` is
  DAPO's clip-higher (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
  Scale", sec. 3.1);
- ``w = exp(logps - old_logps)`` per token (``importance="token"``), or GSPO's sequence ratio
  (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 7): ``exp`` of the mean token log
  ratio of the row, one per row, broadcast over its tokens; or RLOO's (``"sequence_sum"``:
  Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
  Human Feedback in LLMs", the whole completion one action): ``exp`` of the row's summed token log
  ratio, as TRL's ``RLOOTrainer`` computes it. With ``grpo``'s per-row mean a row then adds one term
  whose on-policy gradient is ``-A_i`` times the gradient of the completion's whole log-prob (no
  ``1 / |y_i|`` weighting of short completions);
- ``k3_t = exp(ref - logp) - (ref - logp) - 1``, the k3 estimator of KL(pi || pi_ref) (Schulman
  2020, "Approximating KL Divergence"), as GRPO (eq. 4) and TRL add it.

This is TRL 1.16's ``GRPOTrainer._compute_loss`` for ``loss_type`` in ``AGGREGATIONS``, without
its extras (``delta``, the off-policy mask, the entropy mask and bonus, vLLM importance sampling).
The aggregation is split into this rank's ``loss_sum`` and a unit (`count_units`) that the Task
adds over micro-batches and data-parallel ranks before dividing; with one rank and one
micro-batch, ``loss_sum / count_units`` is TRL's loss:

- ``grpo``: mean over the row's completion tokens, then mean over rows (TRL ``loss_type="grpo"``);
  unit: rows. A row without completion tokens still counts as a row (as in TRL).
- ``dr_grpo``: token sum over ``rows * max_completion_length`` (Liu et al. 2025, "Understanding
  R1-Zero-Like Training", sec. 3.1; TRL ``loss_type="dr_grpo"``); unit: rows, and ``loss_sum``
  is already divided by ``max_completion_length``.
- ``dapo``: token sum over the step's completion tokens (DAPO sec. 3.3, token-level loss; TRL
  ``loss_type="dapo"``, whose ``num_items_in_batch`` is the same global token count); unit:
  completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

AGGREGATIONS = ("grpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence", "sequence_sum")


@dataclass(frozen=True)
class PolicyLoss:
    """What `policy_loss` returns.

    Attributes:
        loss_sum: 0-dim fp32, differentiable w.r.t. ``logps``: this rank's share of the loss before
            the division by the step's global `count_units`.
        sums: detached 0-dim fp32 ``(sum, count)`` per metric, counts in masked completion tokens:
            ``clip_ratio/low`` (ratio below ``1 - epsilon`` with ``A < 0``: the clip holds the
            token's gradient at 0), ``clip_ratio/high`` (above ``1 + epsilon_high`` with ``A > 0``),
            ``clip_ratio/region`` (either), ``ratio`` (the importance ratio) and, when
            ``ref_logps`` is given, ``kl`` (k3). Under ``importance="sequence"`` a row's ratio and
            clip flags count once per token of the row (TRL's ``clip_ratio/*_mean`` counts them once
            per row there).
    """

    loss_sum: Tensor
    sums: dict[str, tuple[Tensor, Tensor]]


def count_units(mask: Tensor, aggregation: str) -> Tensor:
    """This rank's units for ``aggregation``: the Task's divisor once summed over micro-batches and ranks.

    Args:
        mask: ``[R, T]`` bool, True on completion tokens that carry loss.
        aggregation: one of ``AGGREGATIONS``.

    Returns:
        0-dim fp32: ``R`` (rows, including rows without completion tokens) for ``grpo`` and
        ``dr_grpo``; ``mask.sum()`` (completion tokens) for ``dapo``.

    Raises:
        ValueError: an unknown ``aggregation``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; use one of {AGGREGATIONS}")
    if aggregation == "dapo":
        return mask.sum().to(torch.float32)
    return torch.tensor(float(mask.shape[0]), device=mask.device)


def _check(
    logps: Tensor,
    others: dict[str, Tensor | None],
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float,
    epsilon_high: float | None,
    importance: str,
    beta: float,
    aggregation: str,
    max_completion_length: int | None,
) -> None:
    """Raise one ValueError listing every problem with `policy_loss`'s arguments, each with its fix."""
    problems = []
    if aggregation not in AGGREGATIONS:
        problems.append(f"aggregation={aggregation!r}; use one of {AGGREGATIONS}")
    if importance not in IMPORTANCE_LEVELS:
        problems.append(f"importance={importance!r}; use one of {IMPORTANCE_LEVELS}")
    if not epsilon >= 0:
        problems.append(f"epsilon={epsilon} must be >= 0")
    if epsilon_high is not None and not epsilon_high >= 0:
        problems.append(f"epsilon_high={epsilon_high} must be >= 0 (or None: the same as epsilon)")
    if not beta >= 0:
        problems.append(f"beta={beta} must be >= 0")
    if beta > 0 and others["ref_logps"] is None:
        problems.append(f"beta={beta} weighs a KL to the reference: pass ref_logps, or set beta=0")
    if logps.dim() != 2:
        problems.append(f"logps must be [R, T], got shape {tuple(logps.shape)}")
    if mask.shape != logps.shape or mask.dtype != torch.bool:
        problems.append(
            f"mask must be a bool tensor shaped like logps {tuple(logps.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    for name, value in others.items():
        if value is not None and value.shape != logps.shape:
            problems.append(f"{name} must be shaped like logps {tuple(logps.shape)}, got {tuple(value.shape)}")
    if advantages.shape != logps.shape[:1]:
        problems.append(f"advantages must be [R] = {tuple(logps.shape[:1])}, got {tuple(advantages.shape)}")
    if aggregation == "dr_grpo":
        if max_completion_length is None:
            problems.append("aggregation='dr_grpo' divides by max_completion_length: pass it (the generation limit)")
        elif mask.shape == logps.shape and mask.numel():
            # The completion tokens of a row, not the width T: plait's rollout rows hold the prompt
            # and padding too (T = data.seq_len), TRL's hold the completion alone. One host read,
            # dr_grpo only: a rollout step reads its rewards on the host anyway.
            longest = int(mask.sum(-1).max())
            if max_completion_length < longest:
                problems.append(
                    f"max_completion_length={max_completion_length} is below a row's {longest} completion "
                    "tokens: pass the generation limit the rows were sampled with"
                )
    if problems:
        raise ValueError("policy_loss: " + "; ".join(problems))


def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance: Literal["token", "sequence", "sequence_sum"] = "token",
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    aggregation: str = "grpo",
    max_completion_length: int | None = None,
) -> PolicyLoss:
    """The clipped policy-ratio loss of ``R`` completions (see the module docstring), in fp32.

    Positions outside ``mask`` may hold anything, ``inf`` and NaN included: they are selected away
    (``torch.where``) before any arithmetic that could turn them into NaN, so they change neither
    the loss nor the gradient (which is 0 there).

    Args:
        logps: ``[R, T]`` log-probs (nats) of the completion tokens under the policy being trained.
        old_logps: ``[R, T]`` log-probs under the policy that sampled them, or None for on-policy
            (``logps.detach()``: the ratio is exactly 1, TRL's ``num_iterations == 1`` case).
        advantages: ``[R]`` one advantage per row (`trainer.rl.advantages.group_advantages`).
        mask: ``[R, T]`` bool, True on completion tokens that carry loss. A row of False adds 0.
        epsilon: lower clip, ratio >= ``1 - epsilon`` (and the upper one when ``epsilon_high`` is None).
        epsilon_high: upper clip, ratio <= ``1 + epsilon_high`` (DAPO: 0.28); None: ``epsilon``.
        importance: ``"token"`` (PPO/GRPO), ``"sequence"`` (GSPO) or ``"sequence_sum"`` (RLOO).
        beta: weight of the k3 KL to the reference; 0 leaves it out of the loss.
        ref_logps: ``[R, T]`` reference log-probs; needed when ``beta > 0``, logged as ``kl`` when given.
        aggregation: one of ``AGGREGATIONS``; the Task divides ``loss_sum`` by the global `count_units`.
        max_completion_length: the generation limit in tokens, at least every row's completion
            tokens (``mask.sum(-1)``; the width ``T`` may be larger); needed by ``dr_grpo``.

    Returns:
        `PolicyLoss`: ``loss_sum`` and the metric sums.

    Raises:
        ValueError: every invalid argument at once (unknown names, negative epsilons or beta,
            ``beta > 0`` without ``ref_logps``, ``dr_grpo`` without ``max_completion_length`` or
            with one below a row's completion tokens, mismatched shapes, a non-bool mask).
    """
    others = {"old_logps": old_logps, "ref_logps": ref_logps}
    _check(
        logps,
        others,
        advantages,
        mask,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        importance=importance,
        beta=beta,
        aggregation=aggregation,
        max_completion_length=max_completion_length,
    )
    high = epsilon if epsilon_high is None else epsilon_high
    logps = logps.float()
    old = logps.detach() if old_logps is None else old_logps.float()
    zero = logps.new_zeros(())
    # where, not a multiply by the mask: 0 * inf is NaN, in the value and in the gradient.
    log_ratio = torch.where(mask, logps - old, zero)
    tokens_per_row = mask.sum(-1)
    if importance == "sequence":
        log_weight = (log_ratio.sum(-1) / tokens_per_row.clamp(min=1)).unsqueeze(-1)  # [R, 1]
    elif importance == "sequence_sum":
        log_weight = log_ratio.sum(-1, keepdim=True)  # [R, 1]
    else:
        log_weight = log_ratio  # [R, T]
    ratio = torch.exp(log_weight)
    adv = advantages.float().unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv).expand_as(logps)
    kl = None
    if ref_logps is not None:
        ref_minus = torch.where(mask, ref_logps.float() - logps, zero)
        kl = torch.exp(ref_minus) - ref_minus - 1
        if beta > 0:
            per_token = per_token + beta * kl
    # Masked-out positions hold -A (ratio 1) and, under "sequence", the row's term broadcast: drop them.
    per_token = torch.where(mask, per_token, zero)

    if aggregation == "grpo":
        loss_sum = (per_token.sum(-1) / tokens_per_row.clamp(min=1)).sum()
    elif aggregation == "dr_grpo":
        loss_sum = per_token.sum() / max_completion_length
    else:
        loss_sum = per_token.sum()
    return PolicyLoss(loss_sum=loss_sum, sums=_metric_sums(ratio, adv, mask, kl, epsilon=epsilon, high=high))


def _metric_sums(
    ratio: Tensor, adv: Tensor, mask: Tensor, kl: Tensor | None, *, epsilon: float, high: float
) -> dict[str, tuple[Tensor, Tensor]]:
    """Detached masked-token ``(sum, count)`` of the clip fractions, the ratio and the KL."""
    ratio = ratio.detach()
    low = ((ratio < 1 - epsilon) & (adv < 0)).expand_as(mask) & mask
    high_clipped = ((ratio > 1 + high) & (adv > 0)).expand_as(mask) & mask
    tokens = mask.sum().to(torch.float32)
    zero = ratio.new_zeros(())
    sums = {
        "clip_ratio/low": (low.sum().float(), tokens),
        "clip_ratio/high": (high_clipped.sum().float(), tokens),
        "clip_ratio/region": ((low | high_clipped).sum().float(), tokens),
        "ratio": (torch.where(mask, ratio.expand_as(mask), zero).sum(), tokens),
    }
    if kl is not None:
        sums["kl"] = (torch.where(mask, kl.detach(), zero).sum(), tokens)
    return sums
