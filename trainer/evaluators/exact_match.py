"""Held-out exact match by greedy decoding, an evaluator: ``val/exact_match/<source>``.

A data module hands over, per source scored this way (SFT ``metric: exact_match``), the held-out
prompts (token ids, rendered by the run's chat template up to the assistant's turn) and the
expected answers (text). The model continues every prompt greedily for at most the longest
answer's tokens + 2 (trainer.batch_sampling.greedy_batch); a prompt scores 1 when its continuation,
decoded and stripped, equals the answer. The Task calls `evaluate` on every rank, in eval mode,
with no gradient: every rank decodes every prompt (identical results; FSDP needs every rank in
each forward).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strategies.core.resolved import ResolvedRun
from trainer import protocols
from trainer.batch_sampling import greedy_batch
from trainer.data.tokenizer import Tokenizer
from trainer.rl.rollout import before_stop


@dataclass(frozen=True)
class GenerationSet:
    """Held-out prompts of one source (token ids) and their expected answers (text)."""

    prompts: list[list[int]]
    answers: list[str]


class ExactMatch(protocols.Evaluator):
    """Exact match of greedy continuations, per source (see module docstring).

    Args:
        sets: source name -> its held-out prompts and answers.
        tokenizer: decodes the continuations and measures the answers.
        stop_ids: tokens besides EOS that end a continuation (the chat template's end of turn,
            `trainer.data.answer_end.turn_end_ids`).
        stop: texts a continuation is cut before (an end of turn that is no special token,
            `trainer.data.answer_end.turn_end_text`).
    """

    def __init__(
        self,
        sets: dict[str, GenerationSet],
        tokenizer: Tokenizer,
        stop_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        self.sets, self.tokenizer, self.stop_ids, self.stop = sets, tokenizer, tuple(stop_ids), tuple(stop)

    @staticmethod
    def decoded_sources(node: Any) -> list[str]:
        """The names of the sources of a ``data`` node scored this way (``metric: exact_match``)."""
        sources = node.get("sources") if isinstance(node, Mapping) else None
        if not isinstance(sources, Mapping):
            return []
        return [
            name
            for name, source in sources.items()
            if isinstance(source, Mapping) and source.get("metric") == "exact_match"
        ]

    @classmethod
    def problems(cls, run: ResolvedRun | None, node: Any) -> list[str]:
        """Layouts under which the greedy decoding of the ``data`` node's exact-match sources cannot run.

        `trainer.batch_sampling.greedy_batch` feeds whole, growing sequences to the model on every rank:
        a pipeline stage holds part of the layers, a context-parallel rank's attention expects its
        shard of a fixed-length sequence, and sequence-parallel TP shards the residual stream of a
        length tp need not divide. Tensor parallelism without it decodes (the logits are gathered).
        """
        decoded = cls.decoded_sources(node)
        if run is None or not decoded:
            return []
        split = [f"strategy.{axis}={getattr(run.dims, axis)}" for axis in ("pp", "cp") if getattr(run.dims, axis) > 1]
        fix = [f"strategy.{axis}=1" for axis in ("pp", "cp") if getattr(run.dims, axis) > 1]
        if run.sequence_parallel:
            split.append("strategy.tensor_parallel.sequence_parallel=true")
            fix.append("strategy.tensor_parallel.sequence_parallel=false")
        if not split:
            return []
        metric = ", ".join(f"data.sources.{name}.metric=loss" for name in decoded)
        return [
            f"data.sources.{decoded[0]}.metric=exact_match decodes greedily with whole sequences on every rank, which "
            f"{' and '.join(split)} does not give; use {metric} (or {' and '.join(fix)})"
        ]

    @property
    def headline_metrics(self) -> list[str]:
        """Every metric of `evaluate`: ``val/exact_match/<source>`` of the sources with prompts."""
        return [f"val/exact_match/{name}" for name, gen in self.sets.items() if gen.prompts]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """``{"val/exact_match/<source>": fraction of prompts answered exactly}`` (sources
        without prompts are left out)."""
        out = {}
        for name, gen in self.sets.items():
            if not gen.prompts:
                continue
            longest = max(len(self.tokenizer.encode(a)) for a in gen.answers) + 2
            new = greedy_batch(
                model,
                gen.prompts,
                max_new_tokens=longest,
                eos_id=self.tokenizer.eos_id,
                stop_ids=self.stop_ids,
                device=device,
            )
            texts = [before_stop(self.tokenizer.decode(ids), self.stop) for ids in new]
            hits = [text.strip() == answer for text, answer in zip(texts, gen.answers)]
            out[f"val/exact_match/{name}"] = sum(hits) / len(hits)
        return out
