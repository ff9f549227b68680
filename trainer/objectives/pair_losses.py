"""The per-pair losses of the preference objectives (DPO, IPO, SimPO, ORPO) and the sequence
log-probs they read: pure functions on ``[P]`` tensors, no model and no trainer
(`trainer.objectives.preference` adapts them to the Task).

Labels are pre-shifted and -100 everywhere but on response tokens, so a sequence log-prob is a sum
over response tokens only (case C24).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def sequence_logps(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sums of target-token log-probs and per-row counts of targets.

    Args:
        logits_btv: ``[B, T, V]`` logits (a vocabulary-sharded DTensor inside ``loss_parallel()``).
        labels_bt: pre-shifted targets ``[B, T]`` (int64, -100 = no target: prompt and padding).

    Returns:
        ``(logps_b, counts_b)``: fp32 sums of ``log p(label)`` over targets (0 for a row without
        any), and the number of targets per row (fp32).
    """
    token_nll = F.cross_entropy(
        logits_btv.flatten(0, 1).float(), labels_bt.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if isinstance(token_nll, DTensor):
        token_nll = token_nll.full_tensor()
    logps = -token_nll.view(labels_bt.shape).sum(-1)
    return logps, (labels_bt != IGNORE_INDEX).sum(-1).float()


def dpo_loss(
    chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor, *, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss per pair (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7).

    ``loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` with summed response log-probs.

    Args:
        chosen_logratio, rejected_logratio: ``[P]`` summed log pi(y|x) - log pi_ref(y|x), nats.
        beta: strength of the KL constraint to the reference.

    Returns:
        ``(losses, rewards_chosen, rewards_rejected)``, each ``[P]``; reward = beta x log-ratio.
    """
    rewards_c, rewards_r = beta * chosen_logratio, beta * rejected_logratio
    return -F.logsigmoid(rewards_c - rewards_r), rewards_c, rewards_r


def ipo_loss(
    chosen_logratio: torch.Tensor,
    rejected_logratio: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO's squared loss per pair (Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", eq. 17), on **length-averaged** log-ratios (case C25).

    ``h = ratio_c / |y_c| - ratio_r / |y_r|``; ``loss = (h - 1 / (2 beta))^2``. The target
    ``1/(2 beta)`` is on a per-token scale: summed log-ratios would make the loss depend on the
    response lengths.

    Args:
        chosen_logratio, rejected_logratio: ``[P]`` summed log-ratios (nats).
        chosen_tokens, rejected_tokens: ``[P]`` response lengths (targets per row, >= 1).
        beta: regularisation; the target margin is ``1/(2 beta)``.

    Returns:
        ``(losses, rewards_chosen, rewards_rejected)``; reward = beta x averaged log-ratio.
    """
    avg_c, avg_r = chosen_logratio / chosen_tokens.clamp(min=1), rejected_logratio / rejected_tokens.clamp(min=1)
    return (avg_c - avg_r - 1.0 / (2.0 * beta)) ** 2, beta * avg_c, beta * avg_r


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO's loss per pair (Meng et al. 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", eq. 6): reference-free, length-normalised, with a target margin.

    ``loss = -log sigmoid(beta/|y_c| log pi_c - beta/|y_r| log pi_r - gamma)``.

    Args:
        chosen_logps, rejected_logps: ``[P]`` summed policy log-probs (nats).
        chosen_tokens, rejected_tokens: ``[P]`` response lengths.
        beta: reward scale; gamma: target reward margin.

    Returns:
        ``(losses, rewards_chosen, rewards_rejected)``; reward = beta x average log-prob.
    """
    rewards_c = beta * chosen_logps / chosen_tokens.clamp(min=1)
    rewards_r = beta * rejected_logps / rejected_tokens.clamp(min=1)
    return -F.logsigmoid(rewards_c - rewards_r - gamma), rewards_c, rewards_r


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's loss per pair (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", eqs. 6-7): the chosen response's NLL plus an odds-ratio term, reference-free.

    With ``a = log pi(y|x) / |y|`` (average token log-prob) and ``log odds(y) = a - log(1 - e^a)``:
    ``loss = -a_c + lam x -log sigmoid(log odds(y_c) - log odds(y_r))``. The NLL term is the
    chosen response's mean token loss, so each pair weighs the same (the Task averages over pairs).

    Args:
        chosen_logps, rejected_logps: ``[P]`` summed policy log-probs (nats).
        chosen_tokens, rejected_tokens: ``[P]`` response lengths.
        lam: weight of the odds-ratio term (the paper's lambda).

    Returns:
        ``(losses, rewards_chosen, rewards_rejected)``; reward = lam x average log-prob.
    """
    avg_c, avg_r = chosen_logps / chosen_tokens.clamp(min=1), rejected_logps / rejected_tokens.clamp(min=1)

    def log_odds(avg: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # log(1 - e^a) for a < 0, stable near a = 0. A row without targets has a = 0 (odds
        # infinite): it gets a = -1 instead (a constant, no gradient); a confident row keeps its
        # gradient (only a = 0 in floating point is held at the smallest negative normal).
        a = torch.where(tokens > 0, avg.clamp(max=-torch.finfo(avg.dtype).tiny), torch.full_like(avg, -1.0))
        return a - torch.log(-torch.expm1(a))

    ratio_loss = -F.logsigmoid(log_odds(avg_c, chosen_tokens) - log_odds(avg_r, rejected_tokens))
    return -avg_c + lam * ratio_loss, lam * avg_c, lam * avg_r
