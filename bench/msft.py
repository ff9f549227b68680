"""mSFT budget search vs the best uniform-epochs baseline on the synthetic task mixture.

Three synthetic tasks of different difficulty (reversal, sorting, addition; trainer.data.synthetic)
train a nano Llama from scratch. mSFT (trainer.budget.msft) rolls out ``--compute`` epochs of the
active sources, scores every source on its held-out set every ``--eval-every`` steps, rolls back
to the earliest optimum, removes that source and repeats. The uniform baseline trains every source
``--compute`` epochs in one run and keeps its best checkpoint by mean score (the best uniform epoch
count; with ``--patience`` it is a run of its own, else mSFT's first roll-out).

Score per source: ``--metric loss`` (minus the held-out loss; reported as the mean held-out loss,
lower is better) or ``exact_match`` (greedy decoding). FLOPs: training tokens x the model's FLOPs
per token, every roll-out counted in full (also the steps a roll-back discards); the baseline
counts its whole run (the compute needed to find its best epoch count).

Invocation (~10 minutes on 2 cores)::

    OMP_NUM_THREADS=1 python bench/msft.py
    python bench/msft.py --compute 3 --patience 2 --metric exact_match

The last line is ``RESULT msft_metric=<x> uniform_metric=<y> msft_flops_ratio=<mSFT/uniform>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from trainer.budget.msft import MSFT
from trainer.budget.report import table
from trainer.compose import compose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute", type=float, default=3.0)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--metric", choices=("loss", "exact_match"), default="loss")
    parser.add_argument("--model", default="nano")
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()

    overrides = [
        "data=synthetic",
        f"model={args.model}",
        "model.max_seq_len=64",
        "train.global_batch_size=16",
        "optim.lr=3e-3",
        "scheduler=constant",
        "scheduler.warmup_steps=10",
        "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=5",
        "logger=csv",
        "~callbacks.plots",
        *(f"data.sources.{n}.metric={args.metric}" for n in ("reversal", "sorting", "addition")),
    ]
    cfg = compose("sft", overrides)
    out = Path(args.out or tempfile.mkdtemp(prefix="plait-msft-"))
    start = time.perf_counter()
    report = MSFT(compute=args.compute, eval_every=args.eval_every, patience=args.patience, baseline=True).run(cfg, out)
    sign = -1.0 if args.metric == "loss" else 1.0  # scores are -loss: report the loss itself
    msft_metric, uniform_metric = sign * report["final_mean"], sign * report["uniform"]["best_mean"]
    ratio = report["flops"] / report["uniform"]["flops"]
    print()
    print(table(report))
    print(f"held-out {args.metric}: mSFT {msft_metric:.4f} vs best uniform {uniform_metric:.4f}; "
          f"FLOPs mSFT/uniform {ratio:.3f}; {time.perf_counter() - start:.0f} s; run directory {out}")  # fmt: skip
    print(f"RESULT msft_metric={msft_metric:.4f} uniform_metric={uniform_metric:.4f} msft_flops_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
