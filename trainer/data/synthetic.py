"""Synthetic algorithmic SFT tasks, generated deterministically from a seed.

Each task makes single-turn conversations (user: the problem, assistant: the exact answer) whose
held-out exact-match accuracy a small CPU model moves within minutes. Digits and letters are
separated by spaces so a byte-level BPE keeps one symbol per token (merging ``"123"`` into one
token would hide the digits from the model). Difficulties differ on purpose (mSFT needs sources
whose optima differ):

- ``copy``: copy 3-6 distinct letters of a-z (easiest: the SFT stage of the ``copy`` preference
  pairs, trainer.data.preference_sources);
- ``reversal``: reverse 3-5 letters of a-j (easy);
- ``sorting``: sort 4-6 digits (medium);
- ``addition``: add two 1-2 digit numbers (hard for a tiny model: carries);
- ``countdown``: reach a target from three numbers with + - * (`trainer.data.countdown`; its
  answer is one solution of several: scored by the verifier in online RL, `trainer.rl.rewards`).

Train, validation and test examples never overlap: each split draws from its own generator and
an example whose prompt appeared in an earlier split is drawn again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

from trainer.data import countdown
from trainer.data.cache import digest
from trainer.data.chat import Message

Example = tuple[str, str]  # (prompt, answer)
Item = TypeVar("Item", bound=tuple)
_LETTERS = "abcdefghij"


def _spaced(symbols: str) -> str:
    return " ".join(symbols)


def copy(rng: random.Random) -> Example:
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 6))
    return f"copy: {' '.join(letters)}", " ".join(letters)


def reversal(rng: random.Random) -> Example:
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
    return f"reverse: {_spaced(word)}", _spaced(word[::-1])


def sorting(rng: random.Random) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6)))
    return f"sort: {_spaced(digits)}", _spaced("".join(sorted(digits)))


def addition(rng: random.Random) -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add: {_spaced(str(a))} + {_spaced(str(b))}", _spaced(str(a + b))


def countdown_problem(rng: random.Random) -> tuple[str, str, list[int], int]:
    """A Countdown problem: (prompt, one solution, numbers, target)."""
    made = countdown.make(rng)
    numbers = " ".join(map(str, made["numbers"]))
    return f"countdown: {numbers} -> {made['target']}", made["solution"], made["numbers"], made["target"]


def countdown_example(rng: random.Random) -> Example:
    prompt, answer, _, _ = countdown_problem(rng)
    return prompt, answer


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "copy": copy,
    "reversal": reversal,
    "sorting": sorting,
    "addition": addition,
    "countdown": countdown_example,
}
SPLITS = ("train", "val", "test")


def _rng(task: str, seed: int, split: str) -> random.Random:
    return random.Random(int.from_bytes(digest(task, seed, split)[:8], "big"))


def distinct_splits(
    task: str, make: Callable[[random.Random], Item], *, seed: int, sizes: dict[str, int]
) -> dict[str, list[Item]]:
    """Disjoint splits of the items ``make`` draws: ``{"train": [...], "val": [...], "test": [...]}``.

    Each split draws from its own generator, seeded by (task, seed, split); an item whose prompt
    (its first element) appeared in an earlier split, or earlier in this one, is drawn again.

    Args:
        task: the task's name (part of the seed).
        make: draws one item, a tuple whose first element is the prompt.
        seed: the run seed; the same seed gives the same items in every process.
        sizes: items per split (missing splits get none).

    Raises:
        ValueError: a task too small to give that many distinct prompts.
    """
    seen: set[str] = set()
    out: dict[str, list[Item]] = {}
    for split in SPLITS:
        rng, made = _rng(task, seed, split), []
        attempts = 0
        while len(made) < sizes.get(split, 0):
            attempts += 1
            if attempts > 50 * (sizes[split] + 10):
                raise ValueError(f"synthetic task {task!r} cannot give {sizes[split]} distinct {split} examples")
            item = make(rng)
            if item[0] not in seen:
                seen.add(item[0])
                made.append(item)
        out[split] = made
    return out


def examples(task: str, *, seed: int, sizes: dict[str, int]) -> dict[str, list[Example]]:
    """Disjoint splits of ``task`` (see `distinct_splits`).

    Raises:
        ValueError: unknown task, or a task too small to give that many distinct prompts.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {sorted(TASKS)}")
    return distinct_splits(task, TASKS[task], seed=seed, sizes=sizes)


def to_messages(example: Example) -> list[Message]:
    prompt, answer = example
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
