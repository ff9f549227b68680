"""Reward functions of online RL with verifiable rewards, and the weighted set a run uses.

A reward function is any callable ``fn(prompts, completions, **fields) -> list[float]`` (the shape
of TRL's ``reward_funcs``, with texts for both: not TRL's message lists of conversational data):
``prompts`` and ``completions`` are lists of strings (the prompt as the chat template rendered it,
the completion decoded without its EOS), and ``fields`` holds, per
name, the list of the prompts' values of every other column of the prompt table (``answer``,
``numbers``, ``target``, ...), one per completion. It returns one float per completion; a
function should take ``**fields`` so that columns it does not use pass through.

Select them in the data node, each a function (``fn``, built by Hydra: ``_partial_: true`` and
the function's own settings beside ``_target_``) and a weight (the reward of a completion is the
weighted sum)::

    data:
      rewards:
        answer: {fn: {_target_: trainer.rl.rewards.exact_answer, _partial_: true}, weight: 1.0}
        mine: {fn: {_target_: my_package.rewards.brevity, _partial_: true}, weight: 0.1}   # your code

Shipped: `exact_answer`, `countdown` (the Countdown verifier, `trainer.data.countdown.check`),
`format_match` (a regular expression over the whole completion) and `length_penalty`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate

from trainer.data import countdown as countdown_task

RewardFn = Callable[..., Sequence[float]]


def exact_answer(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **fields: Any
) -> list[float]:
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


EXAMPLE = "data.rewards.answer={fn: {_target_: trainer.rl.rewards.exact_answer, _partial_: true}, weight: 1.0}"


def _unlocatable(target: str) -> str | None:
    """Why ``target`` (``module.function``, or ``module.Class.method``) cannot be found, with the fix;
    None when it can (Hydra's rule: the longest prefix that imports, then attributes)."""
    parts = target.split(".")
    found, cut = None, 0
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module)
            break
        except ModuleNotFoundError as err:
            if err.name is not None and err.name != module and not module.startswith(err.name + "."):
                return f"importing {module} needs {err.name}, which is not installed"
        except Exception as err:  # noqa: BLE001 - the user's module raised on import: said, not a traceback
            return f"importing {module} raised {type(err).__name__}: {err}"
    if found is None:
        return (
            f"no module {'.'.join(parts[:-1]) or parts[0]!r}: plait imports your code from the folders named with "
            f"--user-path DIR (plait --user-path . grpo ...) or PLAIT_USER_PATH, or from an installed package, "
            "never from the current folder"
        )
    for depth in range(cut, len(parts)):
        name, where = parts[depth], ".".join(parts[:depth])
        if not hasattr(found, name):
            close = difflib.get_close_matches(name, [n for n in dir(found) if not n.startswith("_")], n=1)
            return f"{where} has no {name!r}" + (f"; did you mean {where}.{close[0]}?" if close else "")
        found = getattr(found, name)
    return None


def node_problems(node: Any) -> list[str]:
    """Problems of a ``data.rewards`` node before anything is built (each naming the fix)."""
    if not node:
        return [f"data.rewards is empty; add one, e.g. {EXAMPLE}"]
    problems = []
    for name, spec in node.items():
        fn = spec.get("fn") if isinstance(spec, Mapping) else None
        if not (isinstance(fn, Mapping) and "_target_" in fn) and not callable(fn):
            problems.append(f"data.rewards.{name} needs fn: {{_target_: <module.function>, _partial_: true}} and a "
                            f"weight, e.g. {EXAMPLE}")  # fmt: skip
        if isinstance(fn, Mapping) and isinstance(fn.get("_target_"), str) and (why := _unlocatable(fn["_target_"])):
            problems.append(f"data.rewards.{name}.fn: {why}")
        unknown = set(spec) - {"fn", "weight"} if isinstance(spec, Mapping) else set()
        if unknown:
            problems.append(f"data.rewards.{name}: unknown keys {sorted(unknown)}; give fn and weight (the "
                            "function's own settings go inside fn)")  # fmt: skip
    return problems


def missing_fields(fn: Callable[..., Any], fields: set[str]) -> list[str]:
    """The parameters ``fn`` (a reward function, or a partial of one) requires beyond
    ``(prompts, completions)`` that neither its partial's keywords nor the prompts' ``fields``
    (their tables' other columns, passed by name) give: the call would raise at the first step."""
    given = set(getattr(fn, "keywords", None) or {}) | fields
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]  # past (prompts, completions)
    # A positional-only one cannot be given by name at all; the others by the partial or a column.
    return [p.name for p in rest if p.default is p.empty and (p.kind is p.POSITIONAL_ONLY or p.name not in given)]


def unaccepted_fields(fn: Callable[..., Any], fields: set[str]) -> list[str]:
    """The prompts' ``fields`` that ``fn`` (a reward function, or a partial of one) cannot take by
    name: every field is passed as a keyword argument (`score`), so without a parameter of that
    name or a ``**fields`` catch-all the call would raise at the first step."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return sorted(fields - named)


def build_rewards(node: Mapping[str, Any]) -> list[Reward]:
    """The rewards of a ``data.rewards`` node: name -> ``{fn, weight}``, ``fn`` a function or a
    Hydra node that builds one (``_partial_: true``).

    Raises:
        RewardError: a problem of `node_problems`, a target Hydra cannot build, or one that does
            not build a function.
    """
    if problems := node_problems(node):
        raise RewardError("; ".join(problems))
    rewards = []
    for name, spec in node.items():
        fn = spec["fn"]
        if isinstance(fn, Mapping):
            try:
                fn = instantiate(fn)
            except Exception as err:  # noqa: BLE001 - Hydra wraps the import or call error
                raise RewardError(f"data.rewards.{name}.fn: {err}") from None
        if not callable(fn):
            raise RewardError(
                f"data.rewards.{name}.fn built a {type(fn).__name__}, not a function; add _partial_: true"
            )
        try:
            weight = float(spec.get("weight", 1.0))
        except (TypeError, ValueError):
            raise RewardError(f"data.rewards.{name}.weight={spec.get('weight')!r}: give a number, e.g. 1.0") from None
        rewards.append(Reward(str(name), fn, weight))
    return rewards


def score(
    rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], fields: Mapping[str, Sequence[Any]]
) -> dict[str, list[float]]:
    """Each reward function's values, by name, one per completion.

    Raises:
        RewardError: a function that raised, or returned another number of values, or values that
            are not finite numbers.
    """
    out = {}
    for reward in rewards:
        try:
            returned = reward.fn(list(prompts), list(completions), **fields)
        except Exception as err:  # noqa: BLE001 - the user's function: name it, keep its traceback
            raise RewardError(
                f"data.rewards.{reward.name} raised {type(err).__name__}: {err} (it gets prompts, completions and "
                f"the fields {sorted(fields)} as keyword arguments; take **fields for the ones it does not use)"
            ) from err
        try:
            values = [float(v) for v in returned]
        except (TypeError, ValueError):
            raise RewardError(
                f"data.rewards.{reward.name} returned {str(returned)[:80]}; return one float per completion "
                "(None, to skip a completion, is not supported)"
            ) from None
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
