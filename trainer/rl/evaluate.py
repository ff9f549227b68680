"""`RewardEvaluator`: held-out prompts answered greedily and scored by the run's rewards.

At each evaluation the model continues every held-out prompt greedily (temperature 0, the KV-cache
sampler `trainer.batch_sampling.sample_batch`, at most ``max_new_tokens``) and the run's reward
functions score the completions: ``val/reward`` (the weighted sum, mean over prompts) and
``val/reward/<name>`` per function. With the exact-answer reward, ``val/reward/<name>`` is the
held-out exact-match accuracy. Every rank decodes every prompt (identical results; FSDP needs
every rank in each forward), as `trainer.evaluators.exact_match` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer import protocols
from trainer.batch_sampling import sample_batch
from trainer.data.tokenizer import Tokenizer
from trainer.rl.rewards import Reward, score, total
from trainer.rl.rollout import before_stop


@dataclass(frozen=True)
class PromptItem:
    """One prompt: its source, its text as the chat template rendered it, its token ids and the
    fields its rewards read (``answer``, ``numbers``, ...)."""

    source: str
    text: str
    ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)


def fields_of(items: Sequence[PromptItem], repeat: int = 1) -> dict[str, list[Any]]:
    """Each field's values, one per completion (every item ``repeat`` times in a row); a field some
    items lack is None for them."""
    names = sorted({name for item in items for name in item.fields})
    return {name: [item.fields.get(name) for item in items for _ in range(repeat)] for name in names}


def completion_text(
    tokenizer: Tokenizer, ids: Sequence[int], stop_ids: Sequence[int] = (), stop: Sequence[str] = ()
) -> str:
    """A completion's text, what its rewards read: its ids without a trailing EOS or stop token
    (``stop_ids``), decoded, and cut before the first stop string (``stop``), as vLLM leaves stop
    strings out of its output (the policy still trains on the tokens that wrote it:
    `trainer.rl.rollout.cut_at_stop`)."""
    ids = list(ids)
    end = ids[-1] if ids else None
    text = tokenizer.decode(ids[:-1] if end == tokenizer.eos_id or end in stop_ids else ids)
    return before_stop(text, stop)


class RewardEvaluator(protocols.Evaluator):
    """Greedy completions of held-out prompts, scored by the rewards (see module docstring).

    Args:
        items: the held-out prompts.
        rewards: the run's reward functions.
        tokenizer: decodes the completions.
        max_new_tokens: tokens per completion at most.
        stop: strings that end a completion (left out of the scored text, as `completion_text` does for the training ones).
        stop_ids: tokens besides EOS that end a completion (the chat template's end of turn,
            `trainer.data.answer_end.turn_end_ids`).
    """

    def __init__(
        self,
        items: Sequence[PromptItem],
        rewards: Sequence[Reward],
        tokenizer: Tokenizer,
        *,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.items, self.rewards, self.tokenizer = list(items), list(rewards), tokenizer
        self.max_new_tokens, self.stop, self.stop_ids = max_new_tokens, tuple(stop), tuple(stop_ids)

    @property
    def headline_metrics(self) -> list[str]:
        return ["val/reward", *(f"val/reward/{r.name}" for r in self.rewards)]

    def completions(self, model: nn.Module, device: torch.device) -> list[str]:
        """The greedy completion of every held-out prompt, decoded."""
        new = sample_batch(
            model,
            [item.ids for item in self.items],
            max_new_tokens=self.max_new_tokens,
            eos_id=self.tokenizer.eos_id,
            stop_ids=self.stop_ids,
            temperature=0.0,
            device=device,
        )
        return [completion_text(self.tokenizer, ids, self.stop_ids, self.stop) for ids in new]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        texts = self.completions(model, device)
        values = score(self.rewards, [item.text for item in self.items], texts, fields_of(self.items))
        n = len(texts)
        out = {"val/reward": sum(total(self.rewards, values)) / n}
        out.update({f"val/reward/{name}": sum(v) / n for name, v in values.items()})
        return out
