"""The generation engine of online RL: what samples the G completions of every prompt.

`GenerationEngine` is the seam: `InProcessEngine` (the default) decodes with the policy itself,
in the training processes, with the batched KV-cache sampler (`trainer.batch_sampling.sample_batch`).
Under FSDP2 it needs no full copy of the model on any rank: each decode step's forward gathers
one block's weights at a time, as a training forward does (FSDP2's pre-forward all-gather,
freed after the block), so every rank must run the same number of decode steps (`all_done`
keeps the ranks in step until every rank's rows have ended).

An engine of its own process (vLLM or SGLang, colocated on the GPUs) implements the same two
calls: `generate` on token ids, and `sync_weights` before each rollout's `generate` (so after every
optimizer step since the last), where it pushes the policy's current weights (gathered from the
shards) into the engine. What such an engine adds, and
what is left to build for it, is in docs/grpo.md ("Generation engines").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from trainer.batch_sampling import sample_batch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled.

    Attributes:
        max_new_tokens: tokens per completion at most (its EOS included).
        temperature: softmax temperature; 0 is greedy.
        top_p: nucleus sampling (Holtzman et al. 2020): the smallest set of tokens whose
            probability reaches ``top_p``; 1.0 keeps all.
        top_k: the ``top_k`` most likely tokens only; None keeps all.
        stop_token_ids: tokens that end a completion as its EOS does, kept in it (the chat
            template's end of turn, `trainer.data.answer_end.turn_end_ids`; vLLM's ``stop_token_ids``).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()


class GenerationEngine(Protocol):
    """Samples completions of token-id prompts from the current policy."""

    def generate(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        *,
        params: SamplingParams,
        eos_id: int,
        seeds: Sequence[int],
        all_done: Callable[[bool], bool] | None,
    ) -> list[list[int]]:
        """The completion of every prompt (ids, its EOS or stop token included when it ended with
        one: ``eos_id`` or one of ``params.stop_token_ids``).

        Args:
            model: the policy (its training processes' copy, parallelized).
            seeds: one per prompt: a completion's randomness depends on its seed alone, not on
                the other prompts of the batch or on how they are split over ranks.
            all_done: called once per decode step with whether this rank's rows have all ended;
                decoding goes on until it returns True (ranks whose forwards are collective).
        """
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Before each rollout's `generate` (after the optimizer steps since the last one): makes the
        engine generate from ``model``'s current weights."""
        ...


class InProcessEngine:
    """Decodes with the policy itself (`trainer.batch_sampling.sample_batch`, KV cache, left padding).

    Args:
        use_cache: decode with the KV cache (False runs the whole context per token; the same tokens).
    """

    def __init__(self, use_cache: bool = True) -> None:
        self.use_cache = use_cache

    def generate(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        *,
        params: SamplingParams,
        eos_id: int,
        seeds: Sequence[int],
        all_done: Callable[[bool], bool] | None,
    ) -> list[list[int]]:
        device = next(model.parameters()).device
        return sample_batch(
            model,
            [list(p) for p in prompts],
            max_new_tokens=params.max_new_tokens,
            eos_id=eos_id,
            stop_ids=params.stop_token_ids,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seeds=list(seeds),
            use_cache=self.use_cache,
            device=device,
            all_done=all_done,
        )

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing: the engine decodes with the live policy."""
        return None
