"""Group-relative advantages: each completion's reward against the other completions of its prompt.

Three estimators of the GRPO family, on rewards ``[N]`` laid out as ``N / G`` prompts of ``G``
contiguous completions (the order the rollout phase produces):

- ``baseline="mean", scale="group"``: GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2), as TRL's
  ``GRPOTrainer._generate_and_score_completions`` computes it: ``(r - group mean) / (group std +
  eps)`` with the **Bessel-corrected** std (``trl.trainer.utils.nanstd`` multiplies the variance by
  ``n / (n - 1)``) and ``eps = 1e-4``.
- ``baseline="mean", scale="none"``: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
  Training: A Critical Perspective", sec. 3.1): no division by the std, which up-weights
  questions whose group rewards barely vary.
- ``baseline="leave_one_out"``: RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting
  REINFORCE Style Optimization for Learning from Human Feedback in LLMs", eq. 7): each reward
  minus the mean of the other ``G - 1`` rewards of its group, ``G / (G - 1)`` times the mean
  baseline's advantage.

NaN rewards (TRL's "unscorable" completions) are not supported: a NaN poisons its whole group here,
where TRL drops it from the baseline and zeroes its advantage. Filter such rows before this call.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

SCALES = ("group", "none")
BASELINES = ("mean", "leave_one_out")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``rewards`` ``[N]`` as fp32 ``[N / G, G]``, after checking the layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be at least 1 (completions per prompt)")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards are not a whole number of groups of group_size={group_size}: "
            "pass prompts x group_size rewards, each prompt's completions contiguous"
        )
    return rewards.to(torch.float32).view(-1, group_size)


def _group_std(grouped: Tensor) -> Tensor:
    """Bessel-corrected std of each group ``[P, 1]`` (0 for groups of one, as TRL does for G = 1).

    Written as TRL's ``nanstd`` writes it (mean of squared deviations times n / (n - 1)) rather
    than ``torch.std``, so the two agree to the last bit or so, not merely to rounding.
    """
    g = grouped.shape[1]
    if g == 1:
        return torch.zeros_like(grouped)
    mean = grouped.mean(dim=1, keepdim=True)
    variance = ((grouped - mean) ** 2).mean(dim=1, keepdim=True) * (g / (g - 1))
    return variance.sqrt()


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: Literal["group", "none"] = "group",
    baseline: Literal["mean", "leave_one_out"] = "mean",
    eps: float = 1e-4,
) -> Tensor:
    """Each completion's advantage over its group (GRPO, Dr. GRPO or RLOO; see the module docstring).

    Args:
        rewards: ``[N]`` scalar rewards, ``N = prompts * group_size``, the ``group_size``
            completions of one prompt contiguous. Any real dtype; computed in fp32. No NaN.
        group_size: ``G``, completions per prompt.
        scale: ``"group"`` divides by the group's Bessel-corrected std plus ``eps`` (GRPO, TRL's
            ``scale_rewards="group"``); ``"none"`` does not (Dr. GRPO, TRL's ``scale_rewards="none"``).
        baseline: ``"mean"`` subtracts the group mean; ``"leave_one_out"`` subtracts the mean of
            the other ``G - 1`` rewards (RLOO).
        eps: added to the std before dividing (TRL: 1e-4); a group whose rewards are all equal
            gets advantage 0.

    Returns:
        ``[N]`` fp32 advantages, in ``rewards``' order.

    Raises:
        ValueError: ``rewards`` not 1-D, ``N`` not a multiple of ``group_size``, ``group_size < 1``,
            ``baseline="leave_one_out"`` with ``group_size < 2``, an unknown ``scale`` or
            ``baseline``, or ``eps < 0``.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; use one of {SCALES}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r}; use one of {BASELINES}")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    grouped = _grouped(rewards, group_size)
    if baseline == "leave_one_out":
        if group_size < 2:
            raise ValueError(f"baseline='leave_one_out' needs group_size >= 2 (got {group_size}): no other rewards")
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        advantages = grouped - others
    else:
        advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (_group_std(grouped) + eps)
    return advantages.reshape(-1)


def group_stats(rewards: Tensor, group_size: int) -> dict[str, Tensor]:
    """Sums over this rank's groups for logging; the caller adds them over ranks and divides.

    Args:
        rewards: ``[N]`` rewards laid out as for `group_advantages`.
        group_size: ``G``, completions per prompt.

    Returns:
        0-dim fp32 tensors: ``num_rows`` (``N``), ``num_groups`` (``N / G``), ``num_zero_std_groups``
        (groups whose Bessel std is within 1e-8 of 0, TRL's ``torch.isclose(std, 0)`` behind its
        ``frac_reward_zero_std``: every completion of the prompt scored the same, so the group gives
        no learning signal), ``reward_sum`` and ``reward_sq_sum`` (for the mean and the batch std).

    Raises:
        ValueError: as `group_advantages` for the layout.
    """
    grouped = _grouped(rewards, group_size)
    std = _group_std(grouped)[:, 0]
    zero = torch.isclose(std, torch.zeros_like(std)).sum().to(torch.float32)
    return {
        "num_rows": torch.tensor(float(grouped.numel()), device=grouped.device),
        "num_groups": torch.tensor(float(grouped.shape[0]), device=grouped.device),
        "num_zero_std_groups": zero,
        "reward_sum": grouped.sum(),
        "reward_sq_sum": (grouped**2).sum(),
    }
