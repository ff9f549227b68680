"""GRPO on the bundled arithmetic task: held-out exact-answer accuracy before and after online RL.

Two runs of plait's real command line, each in a process of its own:

1. ``plait sft``: a nano Llama briefly fine-tuned on the synthetic ``addition`` task ("add: 4 7 + 1 8"
   -> "6 5"; trainer.data.synthetic) from scratch, stopped early (``--sft-steps``) so that it answers
   some held-out prompts right and most wrong;
2. ``plait grpo`` from that model (``model.init_from``, its tokenizer): G = 8 completions per
   prompt sampled by the policy, the exact-answer reward (trainer.rl.rewards.exact_answer), group
   advantages, the clipped policy-ratio loss (``--objective``: grpo, dr_grpo, dapo, gspo, rloo).

Accuracy is the GRPO run's ``val/reward/answer``: the share of the held-out prompts (disjoint from
the training prompts) whose greedy completion is exactly the answer, at step 0 (the SFT model) and
at the last step. The GRPO run directory keeps ``loss.png`` (the training reward of the rollouts
and the held-out reward on a second axis) and ``metrics.csv``.

Invocations (from the repository root)::

    python bench/grpo.py                       # ~7 minutes on 2 CPU cores
    python bench/grpo.py --objective dr_grpo   # a variant
    python bench/grpo.py --out runs/bench-grpo # where both runs go (default: a new runs/bench-grpo-<time>)

The last line is ``RESULT acc_before=<x> acc_after=<y> gain=<y-x> objective=<name> wall_s=<s>``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NANO = ["model=nano", "model.max_seq_len=64"]
COMMON = ["trainer.enable_progress_bar=false", "seed=0"]


def plait(*args: str) -> None:
    """Runs ``plait <args>`` in a process of its own; exits with its status if it fails."""
    command = [sys.executable, "-m", "trainer.cli", *args]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        sys.exit(f"bench/grpo.py: {' '.join(args[:1])} failed with exit {done.returncode}")


def evaluations(run: Path, key: str) -> list[tuple[int, float]]:
    """``(step, key)`` of every evaluation in the run's metrics.csv."""
    with open(run / "metrics.csv", newline="") as f:
        return [(int(float(r["step"])), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", default="grpo", choices=["grpo", "dr_grpo", "dapo", "gspo", "rloo"])
    parser.add_argument("--sft-steps", type=int, default=320)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=4000, help="training prompts (and SFT examples)")
    parser.add_argument("--val", type=int, default=256, help="held-out prompts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or ROOT / "runs" / f"bench-grpo-{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    sft, grpo = out / "sft", out / f"grpo-{args.objective}"
    start = time.perf_counter()
    plait(
        "sft", *NANO, *COMMON, f"run_dir={sft}", "data=synthetic", "~data.sources.reversal", "~data.sources.sorting",
        f"data.sources.addition.limit={args.prompts}", f"data.sources.addition.val_size={args.val}",
        "data.sources.addition.max_epochs=12", f"trainer.max_steps={args.sft_steps}", "train.global_batch_size=32",
        "optim.lr=3e-3", "scheduler=constant", "scheduler.warmup_steps=20", f"train.eval_every={args.sft_steps}",
    )  # fmt: skip
    plait(
        "grpo", *NANO, *COMMON, f"run_dir={grpo}", f"objective={args.objective}", f"model.init_from={sft}",
        f"data.tokenizer={sft / 'tokenizer.json'}", f"data.sources.addition.limit={args.prompts}",
        f"data.sources.addition.val_size={args.val}", "objective.max_new_tokens=8", "train.global_batch_size=128",
        f"trainer.max_steps={args.steps}", f"optim.lr={args.lr}", "scheduler=cosine", "scheduler.warmup_steps=0",
        "train.eval_every=100",
    )  # fmt: skip
    wall = time.perf_counter() - start
    accuracy = evaluations(grpo, "val/reward/answer")
    rewards = evaluations(grpo, "train/reward")
    (_, before), (_, after) = accuracy[0], accuracy[-1]
    print("held-out exact-answer accuracy (greedy) by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in accuracy))
    print(f"training reward (rollouts) first/last logged: {rewards[0][1]:.3f} / {rewards[-1][1]:.3f}")
    print(f"runs: {sft} (SFT base), {grpo} (loss.png: the reward curves)")
    print(
        f"RESULT acc_before={before:.4f} acc_after={after:.4f} gain={after - before:.4f} "
        f"objective={args.objective} wall_s={wall:.0f}"
    )


if __name__ == "__main__":
    main()
