"""Training tokens/s of the default pretrain recipe without compile, with per-block and with whole-model compile.

Each arm is a fresh ``plait pretrain`` process (``strategy.compile.enabled``/``scope``, inductor);
the arms alternate for ``--rounds`` rounds so a change of the machine's load falls on all of them.
An arm's steady figure is the ``perf/tokens_per_s`` that metrics.csv holds at the last step (the
window of the last 10 steps: compile is done by then), its cold cost is the run's wall time over
the uncompiled arm's of the same round (the first round compiles; later rounds reuse inductor's
cache, as a user's second run does).

Prints each arm's mean steady tokens/s and
``RESULT block_over_eager=... model_over_eager=... model_over_block=...`` (tokens/s ratios).

    OMP_NUM_THREADS=2 python bench/compile_scope.py                 # 3 rounds x 3 arms, ~15 minutes on 2 idle cores
    python bench/compile_scope.py --rounds 1 --steps 40             # a quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = {
    "eager": ["strategy.compile.enabled=false"],
    "block": ["strategy.compile.enabled=true", "strategy.compile.scope=block"],
    "model": ["strategy.compile.enabled=true", "strategy.compile.scope=model"],
}


def run_arm(arm: str, steps: int, work: Path) -> dict:
    """Trains ``steps`` steps of the default pretrain recipe in a fresh process; the last window's tokens/s and the wall time."""
    run_dir = work / arm
    command = [
        sys.executable, "-m", "trainer.cli", "pretrain", f"trainer.max_steps={steps}", f"run_dir={run_dir}",
        "train.eval_every=0", "callbacks.throughput.window=10", *ARMS[arm],
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(run_dir / "metrics.csv", newline="") as file:
        rates = [float(row["perf/tokens_per_s"]) for row in csv.DictReader(file) if row.get("perf/tokens_per_s")]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"tokens_per_s": rates[-1], "wall_s": summary["wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (a multiple of 10)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as work:
            for arm in ARMS:
                results[arm].append(run_arm(arm, args.steps, Path(work) / str(round_)))
                last = results[arm][-1]
                print(
                    f"round {round_ + 1} {arm:>5}: {last['tokens_per_s']:,.0f} tokens/s, wall {last['wall_s']:.1f} s",
                    flush=True,
                )
    mean = {arm: statistics.mean(r["tokens_per_s"] for r in rs) for arm, rs in results.items()}
    for arm in ARMS:
        print(f"{arm:>5}: mean {mean[arm]:,.0f} tokens/s over {args.rounds} rounds")
    print(
        f"RESULT block_over_eager={mean['block'] / mean['eager']:.3f} model_over_eager={mean['model'] / mean['eager']:.3f} "
        f"model_over_block={mean['model'] / mean['block']:.3f} rounds={args.rounds} steps={args.steps}"
    )


if __name__ == "__main__":
    main()
