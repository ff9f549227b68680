"""Test doubles of online RL: a generation engine whose completions are fixed by their seeds.

Select it in a composed config (tests/ is on the path of the test process and its forked ranks)::

    ~objective.engine  +objective.engine={_target_:rl_fixtures.ScriptedEngine}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from trainer.rl.engine import SamplingParams


class ScriptedEngine:
    """A `trainer.rl.engine.GenerationEngine` whose completions depend on each row's seed alone,
    never on the model or on the other rows: every layout (one process, DDP, FSDP) trains on the
    same rollouts, and a test's own loop can ask for them again.

    A completion has a length drawn in ``[1, max_new_tokens]``, token ids drawn in ``[low, high)``
    and, for about half the seeds, the EOS as its last token (the others end at the length limit
    without one).

    Args:
        low, high: the range of the drawn token ids; the defaults are the byte tokens of the
            printable ASCII characters ``!`` .. ``~`` of plait's byte-level BPE tokenizers
            (id = byte - 31), each one character when decoded.
    """

    def __init__(self, low: int = 2, high: int = 96) -> None:
        self.low, self.high = low, high

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
        """The scripted completion of every prompt (``model`` and ``all_done`` unused: no forward)."""
        return [self.completion(seed, params.max_new_tokens, eos_id) for seed in seeds]

    def completion(self, seed: int, max_new_tokens: int, eos_id: int) -> list[int]:
        """The completion of ``seed`` (see the class docstring)."""
        generator = torch.Generator().manual_seed(seed)
        length = int(torch.randint(1, max_new_tokens + 1, (), generator=generator))
        ids = torch.randint(self.low, self.high, (length,), generator=generator).tolist()
        if bool(torch.rand((), generator=generator) < 0.5):
            ids[-1] = eos_id
        return ids

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing: the completions do not depend on the weights."""


class CopyEngine(ScriptedEngine):
    """A `ScriptedEngine` that, as a vLLM engine does, keeps its own copy of the weights, refreshed
    only by `sync_weights`; each `generate` appends to the JSON list in ``record`` how far that copy
    is from the policy's live weights (the largest absolute difference, 0.0 when in sync; a file,
    since the runs of the tests are forked)."""

    def __init__(self, record: str) -> None:
        super().__init__()
        self.record = Path(record)
        self.weights: dict[str, torch.Tensor] = {}

    def generate(self, model: nn.Module, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
        live = {name: p.detach() for name, p in model.named_parameters()}
        stale = max((float((live[n] - w).abs().max()) for n, w in self.weights.items()), default=float("inf"))
        seen = json.loads(self.record.read_text()) if self.record.exists() else []
        self.record.write_text(json.dumps([*seen, stale]))
        return super().generate(model, prompts, **kwargs)

    def sync_weights(self, model: nn.Module) -> None:
        self.weights = {name: p.detach().clone() for name, p in model.named_parameters()}
