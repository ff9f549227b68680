"""Preference pairs: real ones shipped with plait or a pip package and synthetic verifiable ones (a user's table: trainer.data.formats).

A pair is ``{"messages": [...], "chosen": str, "rejected": str}``: the prompt conversation (system,
user, earlier assistant turns) and two candidate final assistant answers.

========== ============================================ ====== ===================================
name       where                                        pairs  label
========== ============================================ ====== ===================================
dpo_en     ``trainer/data/bundled/dpo_en_demo``          300   human/AI preference as published
           (LLaMA-Factory 0.9.5 ``data/``)                     (Apache-2.0, HF llamafactory/demo_data)
champ      ``champ-dataset==1.0.0`` model runs           1,283 outcome: a run whose final integer
           (GPT-3.5/4, PaLM 2) on integer-answer               answer equals the gold answer is chosen
           problems                                            over one that does not (MIT)
========== ============================================ ====== ===================================

Synthetic verifiable sets (`SYNTHETIC`), deterministic from a seed, disjoint train/val prompts:

- ``copy``: "copy: k q z m" -> chosen the same letters, rejected one letter replaced by a letter
  the prompt does not contain (verifiable by comparison);
- ``addition``: "add: 2 7 + 4 5" -> chosen the correct sum, rejected the sum with one digit changed.

Sources: shared/research/data.md section 4.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from trainer.data import bundled, instructions
from trainer.data.synthetic import distinct_splits

Pair = dict[str, Any]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def dpo_en() -> list[Pair]:
    """The llamafactory demo preference set: 300 pairs (114 single-turn, 80 with a system prompt,
    106 multi-turn)."""
    rows = bundled.read_json("dpo_en_demo.json")
    return [
        {
            "messages": [{"role": _ROLES[m["from"]], "content": m["value"]} for m in r["conversations"]],
            "chosen": r["chosen"]["value"],
            "rejected": r["rejected"]["value"],
        }
        for r in rows
    ]


def _final_integer(text: str) -> str | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return found[-1] if found else None


def champ() -> list[Pair]:
    """Answer-verified pairs from CHAMP's model runs: per integer-answer problem, the i-th correct
    run is paired with the i-th wrong one (the final message holds the run's answer)."""
    path = instructions._package_dir("champ_dataset", "champ-dataset==1.0.0") / "dataset_files" / "v0.json"
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    pairs = []
    for problem in problems.values():
        answer = str(problem["_answer"]).strip()
        if not re.fullmatch(r"-?\d+", answer):
            continue
        runs = [c["messages"] for c in problem["conversations"].values()]
        runs = [m for m in runs if len(m) >= 5 and all(x.get("text") for x in m)]
        good = [m for m in runs if _final_integer(m[-1]["text"]) == answer]
        bad = [m for m in runs if _final_integer(m[-1]["text"]) != answer]
        prompt = [{"role": "user", "content": problem["_text"]}]
        # The run's solution is its third message (after the system and problem messages).
        pairs += [{"messages": prompt, "chosen": g[2]["text"], "rejected": b[2]["text"]} for g, b in zip(good, bad)]
    return pairs


BUNDLED: dict[str, Callable[[], list[Pair]]] = {"dpo_en": dpo_en, "champ": champ}


def _copy_task(rng: random.Random) -> tuple[str, str, str]:
    letters = rng.sample(_LETTERS, rng.randint(3, 6))
    wrong = list(letters)
    wrong[rng.randrange(len(wrong))] = rng.choice([c for c in _LETTERS if c not in letters])
    return f"copy: {' '.join(letters)}", " ".join(letters), " ".join(wrong)


def _addition_task(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = str(a + b)
    i = rng.randrange(len(right))
    digit = rng.choice([d for d in "0123456789" if d != right[i] and not (i == 0 and d == "0")])
    wrong = right[:i] + digit + right[i + 1 :]
    return f"add: {' '.join(str(a))} + {' '.join(str(b))}", " ".join(right), " ".join(wrong)


SYNTHETIC: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {"copy": _copy_task, "addition": _addition_task}


def synthetic(task: str, *, seed: int, sizes: dict[str, int]) -> dict[str, list[Pair]]:
    """Disjoint ``train`` and ``val`` pairs of a synthetic task (no prompt appears in both).

    Raises:
        ValueError: unknown task, or more distinct prompts asked for than the task can give.
    """
    if task not in SYNTHETIC:
        raise ValueError(f"unknown synthetic preference task {task!r}; choose from {sorted(SYNTHETIC)}")
    made = distinct_splits(task, SYNTHETIC[task], seed=seed, sizes=sizes)
    return {
        split: [{"messages": [{"role": "user", "content": p}], "chosen": c, "rejected": r} for p, c, r in items]
        for split, items in made.items()
    }
