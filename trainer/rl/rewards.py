"""Reward functions of online RL with verifiable rewards, and the weighted set a run uses.

A reward function is any callable ``fn(prompts, completions, **fields) -> list[float]`` (TRL's
``reward_funcs`` signature): ``prompts`` and ``completions`` are lists of texts (the prompt as the
chat template rendered it, the completion decoded without its EOS), and ``fields`` holds, per
name, the list of the prompts' values of every other column of the prompt table (``answer``,
``numbers``, ``target``, ...), one per completion. It returns one float per completion; a
function should take ``**fields`` so that columns it does not use pass through.

Select them in the data node, each with a weight (the reward of a completion is the weighted sum)::

    data:
      rewards:
        answer: {_target_: trainer.rl.rewards.exact_answer, _partial_: true, weight: 1.0}
        mine: {_target_: my_package.rewards.brevity, _partial_: true, weight: 0.1}   # your code

Shipped: `exact_answer`, `countdown` (the Countdown verifier, `trainer.data.countdown.check`),
`format_match` (a regular expression over the whole completion) and `length_penalty`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.data import countdown as countdown_task

RewardFn = Callable[..., Sequence[float]]


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **fields: Any) -> list[float]:
    """1.0 where the completion, stripped, equals the ``answer`` field, stripped; else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def countdown(
    prompts: Sequence[str], completions: Sequence[str], numbers: Sequence[Sequence[int]], target: Sequence[int],
    **fields: Any,
) -> list[float]:  # fmt: skip
    """1.0 where the completion is an expression that uses each of ``numbers`` once and equals
    ``target`` (`trainer.data.countdown.check`); else 0.0."""
    return [float(countdown_task.check(c, list(n), int(t))) for c, n, t in zip(completions, numbers, target)]


def format_match(prompts: Sequence[str], completions: Sequence[str], *, pattern: str, **fields: Any) -> list[float]:
    """1.0 where the whole completion matches the regular expression ``pattern`` (``re.fullmatch``,
    DOTALL); else 0.0. E.g. ``pattern: '[0-9 ]+'`` rewards an answer made of digits only."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(prompts: Sequence[str], completions: Sequence[str], *, limit: int, **fields: Any) -> list[float]:
    """0.0 up to ``limit`` characters, then -1.0 per ``limit`` characters beyond it (linear)."""
    return [-max(0, len(c) - limit) / limit for c in completions]


@dataclass(frozen=True)
class Reward:
    """One reward function of a run, its name (``train/reward/<name>``) and weight."""

    name: str
    fn: RewardFn
    weight: float


class RewardError(ValueError):
    """A reward function that cannot be built or returned something unusable; names the fix."""


def build_rewards(node: Mapping[str, Any]) -> list[Reward]:
    """The rewards of a ``data.rewards`` node (name -> ``{_target_, _partial_: true, weight, ...}``).

    Raises:
        RewardError: an empty node, a missing ``_target_``, or a target Hydra cannot build.
    """
    from hydra.utils import instantiate

    if not node:
        raise RewardError("data.rewards is empty; add one, e.g. data.rewards.answer={_target_: "
                          "trainer.rl.rewards.exact_answer, _partial_: true, weight: 1.0}")  # fmt: skip
    rewards = []
    for name, spec in node.items():
        spec = dict(spec)
        weight = float(spec.pop("weight", 1.0))
        if "_target_" not in spec:
            raise RewardError(f"data.rewards.{name} has no _target_; give the function, e.g. _target_: "
                              "trainer.rl.rewards.exact_answer, _partial_: true")  # fmt: skip
        try:
            fn = instantiate(spec)
        except Exception as err:  # Hydra wraps the import or call error
            raise RewardError(f"data.rewards.{name}: {err}") from None
        if not callable(fn):
            raise RewardError(f"data.rewards.{name}: {spec['_target_']} built a {type(fn).__name__}, not a function; "
                              "a function needs _partial_: true")  # fmt: skip
        rewards.append(Reward(str(name), fn, weight))
    return rewards


def score(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], fields: Mapping[str, Sequence[Any]]
) -> dict[str, list[float]]:
    """Each reward function's values, by name, one per completion.

    Raises:
        RewardError: a function that returned another number of values, or values that are not
            finite numbers.
    """
    out = {}
    for reward in rewards:
        values = [float(v) for v in reward.fn(list(prompts), list(completions), **fields)]
        if len(values) != len(completions):
            raise RewardError(
                f"data.rewards.{reward.name} returned {len(values)} values for {len(completions)} completions; "
                "return one float per completion"
            )
        if not all(v == v and abs(v) != float("inf") for v in values):
            raise RewardError(f"data.rewards.{reward.name} returned a value that is not finite; return finite floats")
        out[reward.name] = values
    return out


def total(rewards: Sequence[Reward], values: Mapping[str, Sequence[float]]) -> list[float]:
    """The weighted sum of the reward functions' values, per completion."""
    n = len(next(iter(values.values()))) if values else 0
    return [sum(r.weight * values[r.name][i] for r in rewards) for i in range(n)]
