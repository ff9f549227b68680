"""The training and held-out Countdown problems of a ReST run, drawn apart from its seed."""

from __future__ import annotations

import random
from typing import Any

from trainer.config import ConfigError
from trainer.rest.sos import make_problem

DIFFICULTY = ("count", "high", "max_target")  # make_problem's knobs


def problems(seed: int, *, train: int, held_out: int, **difficulty: Any) -> tuple[list[dict], list[dict]]:
    """Distinct training and held-out problems (no held-out problem's numbers and target among the
    training ones), drawn from ``seed`` with `make_problem`'s difficulty knobs.

    Raises:
        ConfigError: the difficulty has too few distinct problems (no new one in a row of 10 draws
            per problem asked for).
    """
    unknown = sorted(set(difficulty) - set(DIFFICULTY))
    if unknown:
        raise ConfigError([f"rest.problems.{k}: not a difficulty knob; use {', '.join(DIFFICULTY)}" for k in unknown])
    rng, seen, out, misses = random.Random(f"rest-{seed}"), set(), [], 0
    while len(out) < train + held_out:
        p = make_problem(rng, **difficulty)
        key = (tuple(sorted(p["numbers"])), p["target"])
        if key in seen:
            misses += 1
            if misses > 10 * (train + held_out):
                raise ConfigError(
                    [
                        f"rest.problems: {len(out)} distinct problems found of the {train + held_out} asked for "
                        f"(train {train} + held_out {held_out}) at {difficulty}; lower rest.problems.train, or raise "
                        "rest.problems.high or rest.problems.max_target"
                    ]
                )
            continue
        seen.add(key)
        out.append(p)
        misses = 0
    return out[:train], out[train:]
