"""The rows a rollout trains on, and the pieces of a rollout that are not the sampler.

A rollout row is ``prompt + completion + padding`` (``width`` tokens, right padding): the forward
is plain causal attention from position 0, so the padding after a row's last token changes
nothing before it, and every row computes what it computes alone. ``labels[t]`` is the completion
token at t + 1 (its EOS included), -100 elsewhere (pre-shifted, as every plait label is): the
policy loss covers exactly the completion's tokens. ``source_ids`` is 0 on the prompt and completion
and -1 on the padding, the packer's mark (`trainer.data.packing`): a routed model leaves the padding
out of its routers' loads and losses (`strategies.core.model_contract.model_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.data.cache import digest
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import Tokenizer


def completion_seed(seed: int, rollout: int, prompt_index: int, sample: int) -> int:
    """The sampling seed of completion ``sample`` of prompt ``prompt_index`` in rollout ``rollout``
    (a 63-bit int from sha256): the same wherever the prompt is sampled (any rank, any batch)."""
    return int.from_bytes(digest("rollout", seed, rollout, prompt_index, sample)[:8], "big") >> 1


def cut_at_stop(ids: Sequence[int], tokenizer: Tokenizer, stop: Sequence[str]) -> list[int]:
    """``ids`` up to and including the first token whose text completes a stop string (the shortest
    prefix whose decoded text contains one); ``ids`` unchanged without one."""
    ids = list(ids)
    if not stop or not any(s in tokenizer.decode(ids) for s in stop):
        return ids
    for end in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[:end]) for s in stop):
            return ids[:end]
    return ids


def before_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to its first stop string (not included); all of it without one."""
    return text[: min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]


def rollout_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, width: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels", "source_ids"}`` ``[R, width]`` of the rollout rows (module docstring).

    Raises:
        ValueError: a prompt + completion longer than ``width``.
    """
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    source_ids = torch.full((len(prompts), width), -1, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = list(prompt) + list(completion)
        if len(ids) > width:
            raise ValueError(f"a prompt of {len(prompt)} + completion of {len(completion)} tokens exceeds {width}")
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        source_ids[row, : len(ids)] = 0
        if completion:
            labels[row, len(prompt) - 1 : len(ids) - 1] = torch.tensor(list(completion), dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels, "source_ids": source_ids}


def token_logps(logits_btv: torch.Tensor, labels_bt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` fp32 log-probability of each label under ``softmax(logits / temperature)`` (0 where
    the label is -100): the policy that sampled at that temperature (1 for a temperature of 0, greedy)."""
    return _picked(torch.log_softmax(_tempered(logits_btv, temperature), dim=-1), labels_bt)


def token_logps_and_entropy(
    logits_btv: torch.Tensor, labels_bt: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logps` and the ``[B, T]`` entropy (nats, no gradient) of each position's next-token
    distribution at ``temperature``, from one log-softmax over the vocabulary."""
    logps = torch.log_softmax(_tempered(logits_btv, temperature), dim=-1)
    with torch.no_grad():
        detached = logps.detach()
        entropy = -(detached.exp() * detached).sum(-1)
    return _picked(logps, labels_bt), entropy


def _tempered(logits_btv: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / temperature`` (as TRL's GRPO scores the sampling policy: Shao et al. 2024's
    pi_theta_old is the distribution the completions were drawn from); greedy (0) and 1 leave them."""
    logits = logits_btv.float()
    return logits if temperature in (0.0, 1.0) else logits / temperature


def _picked(logps_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    picked = logps_btv.gather(-1, labels_bt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels_bt != IGNORE_INDEX, picked, torch.zeros_like(picked))
