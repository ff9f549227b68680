"""Guided-ReST against plain ReST on a small Countdown: held-out solve rate after each self-training round.

One ``plait rest`` run (recipes/rest.yaml, trainer/rest/driver.py) in a process of its own: round 0
fine-tunes the tiny Llama from scratch on the symbolic searcher's traces of 1500 training problems
(3 numbers from 1..12, targets up to 60; the recipe's defaults); then for ``--rounds`` rounds each arm samples traces of
the training problems with its own model, the guided arm inserts the optimal solution's landmarks
into its failed traces, and each arm fine-tunes its model on its kept traces for the same number of
optimizer steps of packed rows (equal training tokens). Every model decodes the held-out problems
greedily; the solve rate is the share whose trace reaches the target within the token budget.

Invocations (from the repository root)::

    python bench/rest.py                     # ~17 minutes on 2 CPU cores
    python bench/rest.py --rounds 1          # one round per arm
    python bench/rest.py --out runs/bench-rest   # where the run goes (default: runs/bench-rest-<time>)
    python bench/rest.py rest.steps=100          # any override of recipes/rest.yaml

The run directory keeps ``rest.json``, ``rest.png`` (solve rate against round and against the
generation budget) and each round's traces, statistics, fit and evaluation. The last line is
``RESULT solve_unguided=<x> solve_guided=<y> rounds=<k> budget=<tokens> tokens_unguided=<n>
tokens_guided=<n> wall_s=<s>``: the rates after round 1, where both arms' only difference is the
data they trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / f"bench-rest-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("overrides", nargs="*", help="more overrides of recipes/rest.yaml (rest.steps=100 ...)")
    args = parser.parse_args()
    start = time.perf_counter()
    command = [
        sys.executable, "-m", "trainer.cli", "rest", f"run_dir={args.out}", "seed=0", "trainer.enable_progress_bar=false",
        f"rest.rounds={args.rounds}", *args.overrides,
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL
    )
    if done.returncode:
        sys.exit(f"bench/rest.py: plait rest failed with exit {done.returncode}")
    report = json.loads((args.out / "rest.json").read_text())
    budget = str(max(report["budgets"]))
    first = {arm: entries[1] for arm, entries in report["arms"].items()}
    for arm, entries in report["arms"].items():
        for e in entries:
            rates = " ".join(f"@{b}={r:.3f}" for b, r in e["solve_rate"].items())
            print(
                f"{arm:<9} round {e['round']}: kept {e['stats']['kept']:>4}  train tokens {e['train_tokens']:>8}  {rates}"
            )
    print(
        f"RESULT solve_unguided={first['unguided']['solve_rate'][budget]:.3f} "
        f"solve_guided={first['guided']['solve_rate'][budget]:.3f} rounds={args.rounds} budget={budget} "
        f"tokens_unguided={first['unguided']['train_tokens']} tokens_guided={first['guided']['train_tokens']} "
        f"wall_s={time.perf_counter() - start:.0f}"
    )


if __name__ == "__main__":
    main()
