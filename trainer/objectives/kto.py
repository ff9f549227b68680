"""KTO: Kahneman-Tversky Optimization on unpaired preference rows (Ethayarajh et al. 2024, "KTO:
Model Alignment as Prospect Theoretic Optimization", eq. 8), in TRL's formulation (``KTOTrainer``).

A batch holds unpaired rows (`trainer.data.preference` with ``unpaired: true``): ``[P, 2, T]``
row pairs whose index 0 is the prompt with its own completion and index 1 the same prompt with a
mismatched completion (another row's), ``desirable`` ``[P]`` (1.0: a desirable completion), and
``ref_logps`` ``[P, 2]`` (the reference pre-pass of `PreferenceObjective.before_fit`).

With ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the completion's tokens) and the KL
estimate ``z = max(0, mean over the mismatched rows of their r)`` (detached; the mean is over
one micro-step's rows on **all** ranks, as TRL gathers it over processes)::

    desirable:    loss = desirable_weight   * (1 - sigmoid(beta * (r - z)))
    undesirable:  loss = undesirable_weight * (1 - sigmoid(beta * (z - r)))

and the Task averages the per-row losses over the step's rows (``count_unit = "pairs"``: rows).
With gradient accumulation the KL estimate is per micro-step (TRL's is per device batch too).

Logged: ``rewards/chosen`` and ``rewards/rejected`` (mean ``beta r`` of the desirable and of the
undesirable rows), ``rewards/mismatched`` (mean ``beta r`` of the mismatched rows, before the clamp:
below 0 the policy has moved away from other prompts' completions and ``z`` is clamped to 0, so
the KL term is inactive) and ``kl`` (the mean estimate ``z``).
"""

from __future__ import annotations

from typing import Annotated

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from strategies.core.ranges import POSITIVE
from trainer.objectives.preference import PreferenceObjective, held_pairs

KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/mismatched", "kl")


def kl_estimate(mismatched_logratio: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``z``: the mean log-ratio of the mismatched rows over every rank, clamped at 0, detached.

    Args:
        mismatched_logratio: ``[P]`` summed log pi - log pi_ref of this rank's mismatched rows (nats).
        held: ``[P]`` bool, the rows that count (`trainer.objectives.preference.held_pairs`: not the
            stand-in of an evaluation rank without rows).

    Returns:
        0-dim fp32 tensor (the same on every rank). Tensor- and sequence-parallel ranks hold the
        same rows as their data-parallel peers, which leaves the mean unchanged.
    """
    ratio = mismatched_logratio.detach().float()
    sums = torch.stack([torch.where(held, ratio, 0.0).sum(), held.sum().float()])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)


def kto_loss(
    logratio: torch.Tensor,
    kl: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's loss per row (module docstring).

    Args:
        logratio: ``[P]`` summed log pi(y|x) - log pi_ref(y|x) of each row's own completion (nats).
        kl: 0-dim KL estimate ``z`` (`kl_estimate`; no gradient flows through it).
        desirable: ``[P]`` bool, True for a desirable completion.
        beta: KL strength (0.1 in the paper and TRL).
        desirable_weight, undesirable_weight: the paper's lambda_D and lambda_U.

    Returns:
        ``(losses, rewards)``, each ``[P]``; reward = beta x log-ratio.
    """
    gain = desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl)))
    loss = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio)))
    return torch.where(desirable, gain, loss), beta * logratio


class KTO(PreferenceObjective):
    """KTO (unpaired rows; `kto_loss`).

    Args:
        beta: KL strength (0.1).
        desirable_weight, undesirable_weight: loss weights of the two labels (1.0 each; the paper
            suggests keeping ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)``
            in [1, 4/3]).

    Raises:
        ValueError: beta or a weight that is not positive.
    """

    row_kind = "unpaired"
    step_count_name = "completions"  # each with its KL row
    # Unpaired rows have no pairwise accuracy: the held-out rewards of the desirable rows rise
    # above those of the undesirable ones as the policy learns the labels.
    headline_metrics = ("rewards/chosen", "rewards/rejected")

    def __init__(
        self,
        beta: Annotated[float, POSITIVE] = 0.1,
        desirable_weight: Annotated[float, POSITIVE] = 1.0,
        undesirable_weight: Annotated[float, POSITIVE] = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("beta", beta),
            ("desirable_weight", desirable_weight),
            ("undesirable_weight", undesirable_weight),
        ):
            if not value > 0:
                raise ValueError(f"objective.{name}={value} must be positive")
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self._kto_sums: torch.Tensor | None = None  # [2, 4]: metric sums, metric counts

    @override
    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed KTO loss of ``batch``'s rows (0-dim fp32); adds the reward and KL metrics to the sums.

        Raises:
            KeyError: a batch without ``ref_logps`` or ``desirable`` (not unpaired rows).
        """
        logps, _ = self.sequence_logps_of(model, batch)
        ratio = logps - batch["ref_logps"].to(logps.dtype)
        held = held_pairs(batch)  # not the stand-in row of an evaluation rank without rows
        kl = kl_estimate(ratio[:, 1], held)
        desirable = batch["desirable"] > 0.5
        losses, rewards = kto_loss(
            ratio[:, 0],
            kl,
            desirable,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        rewards, d, h = rewards.detach().float(), desirable.float(), held.float()
        rewards, mismatched = (
            torch.where(held, rewards, 0.0),
            torch.where(held, self.beta * ratio[:, 1].detach().float(), 0.0),
        )
        batches = (h.sum() > 0).float()  # the KL estimate counts once per micro-batch that holds rows
        sums = torch.stack([
            torch.stack([(rewards * d).sum(), (rewards * (1 - d)).sum(), mismatched.sum(), kl * batches]),
            torch.stack([(d * h).sum(), ((1 - d) * h).sum(), h.sum(), batches]),
        ])  # fmt: skip
        self._kto_sums = sums if self._kto_sums is None else self._kto_sums + sums
        return torch.where(held, losses, 0.0).sum()

    @override
    def pop_sums(self) -> tuple[list[str], torch.Tensor] | None:
        """``(KTO_METRICS, [2, 4])``: this rank's metric sums since the last call and their counts."""
        sums, self._kto_sums = self._kto_sums, None
        return list(KTO_METRICS), torch.zeros(2, len(KTO_METRICS), dtype=torch.float32) if sums is None else sums
