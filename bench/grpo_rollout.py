"""Rollout time of ``plait grpo`` under DDP and under FSDP2 (2 processes each), side by side.

Under FSDP2 the sampler runs the sharded policy itself: every decode step all-gathers each block's
weights for its forward and frees them after (no full copy of the model on any rank), and the ranks
decode in step until all their rows have ended. Under DDP each rank holds the whole model and decodes
alone. The script runs the same short GRPO run in both layouts and prints the mean of
``train/time/rollout_s`` (the sampling of one rollout on a rank, from metrics.csv) and the ratio.

Invocation (from the repository root)::

    python bench/grpo_rollout.py            # ~2 minutes on 2 CPU cores
    python bench/grpo_rollout.py --model tiny --steps 10

The last line is ``RESULT rollout_s_ddp=<s> rollout_s_fsdp=<s> fsdp_over_ddp=<ratio>``.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rollout_seconds(strategy: str, args: argparse.Namespace, run_dir: Path) -> float:
    command = [
        sys.executable, "-m", "trainer.cli", "grpo", f"model={args.model}", "model.max_seq_len=64",
        f"strategy={strategy}", "trainer.devices=2", f"trainer.max_steps={args.steps}", "train.eval_every=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "~callbacks.checkpoint",
        f"objective.max_new_tokens={args.new_tokens}", "train.global_batch_size=64", f"run_dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench/grpo_rollout.py: strategy={strategy} failed:\n{done.stderr[-3000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        values = [float(r["train/time/rollout_s"]) for r in csv.DictReader(f) if r.get("train/time/rollout_s")]
    values = values[1:]  # the first rollout warms up (allocations, first gathers)
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ddp = rollout_seconds("ddp", args, Path(tmp) / "ddp")
        fsdp = rollout_seconds("fsdp", args, Path(tmp) / "fsdp")
    print(f"model={args.model} 2 processes, 4 prompts x 8 completions per rank, up to {args.new_tokens} new tokens")
    print(f"RESULT rollout_s_ddp={ddp:.3f} rollout_s_fsdp={fsdp:.3f} fsdp_over_ddp={fsdp / ddp:.2f}")


if __name__ == "__main__":
    main()
