"""DPO on a synthetic verifiable preference set: held-out reward accuracy before and after training.

The set (trainer.data.preference_sources, ``copy`` by default): the prompt asks to copy 3-6
distinct letters; the chosen answer copies them, the rejected answer has one letter replaced by a
letter the prompt does not contain. Train and held-out prompts are disjoint, so a held-out
accuracy above chance means the policy learnt the rule, not the pairs.

Reward accuracy is DPO's: the share of held-out pairs whose implicit reward
``beta x (log pi(y|x) - log pi_ref(y|x))`` is higher for the chosen answer (a tie counts 1/2).
Before training the policy is its reference, every margin is exactly 0, and the accuracy is 0.5.
The script also prints the initial model's own preference (log pi_ref(chosen) > log pi_ref(rejected)),
which is chance too for a fresh model.

It runs plait's real path in this process: the ``dpo`` recipe composed with the overrides below,
``trainer.build.build_run``, Lightning ``fit`` (devices=1), the reference log-probs from the data
module's pre-pass, the metrics from the Task's evaluations at step 0 and at the last step.

Invocations::

    OMP_NUM_THREADS=2 python bench/dpo.py                     # ~4 minutes on 2 idle CPU cores
    python bench/dpo.py --task addition                       # the harder arithmetic set
    python bench/dpo.py --objective ipo                       # another reference-based loss

The last line is ``RESULT reward_acc_before=<x> reward_acc_after=<y> ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.build import build_run  # noqa: E402
from trainer.compose import compose  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="copy", choices=["copy", "addition"])
    parser.add_argument("--objective", default="dpo", choices=["dpo", "ipo"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--train-pairs", type=int, default=4000)
    parser.add_argument("--val-pairs", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", default="nano")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    overrides = [
        f"model={args.model}", f"objective={args.objective}", "data=preference_synthetic",
        "~data.sources.copy", f"+data.sources.pairs={{source: {args.task}, limit: {args.train_pairs}, val_size: {args.val_pairs}}}",
        "train.global_batch_size=32", "train.eval_every=0", f"trainer.max_steps={args.steps}",
        "optim.lr=" + str(args.lr), f"objective.beta={args.beta}", "scheduler=constant", "scheduler.warmup_steps=20", f"seed={args.seed}",
        "trainer.enable_progress_bar=false", "logger=none", "~callbacks.plots", "~callbacks.checkpoint",
    ]  # fmt: skip
    cfg = compose("dpo", overrides)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, task, data = build_run(cfg, Path(run_dir))
        trainer.fit(task, datamodule=data)
    wall = time.perf_counter() - start
    # An evaluation's entry holds the objective's sums under "metrics" (Task.evaluate).
    evals = [
        {"step": h["step"], **h["metrics"]} for h in task.history if "val/rewards/accuracy" in h.get("metrics", {})
    ]
    before, after = evals[0], evals[-1]
    ref = data.prepare().val_ref
    base_pref = ((ref[:, 0] > ref[:, 1]).float() + 0.5 * (ref[:, 0] == ref[:, 1]).float()).mean().item()
    print(
        f"task={args.task} objective={args.objective} steps={args.steps} train_pairs={args.train_pairs} "
        f"held-out pairs={len(ref)} wall={wall:.0f}s"
    )
    print(f"initial model's own preference accuracy (log pi_ref(chosen) > log pi_ref(rejected)): {base_pref:.3f}")
    for name, h in (("before", before), ("after", after)):
        print(
            f"{name:>6} (step {h['step']}): reward accuracy {h['val/rewards/accuracy']:.3f}, margin "
            f"{h['val/rewards/margin']:.3f}, rewards chosen {h['val/rewards/chosen']:.3f} / rejected {h['val/rewards/rejected']:.3f}"
        )
    print(
        f"RESULT reward_acc_before={before['val/rewards/accuracy']:.3f} reward_acc_after={after['val/rewards/accuracy']:.3f} "
        f"base_pref_acc={base_pref:.3f} margin_after={after['val/rewards/margin']:.3f} steps={args.steps} wall_s={wall:.0f}"
    )


if __name__ == "__main__":
    main()
