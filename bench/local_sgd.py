"""Local SGD against DDP at equal tokens: final validation loss and bytes sent across replicas.

The papers' regime: DiLoCo (Douillard et al. 2023) and DES-LOC (Iacob et al. 2025) start from a
pretrained (or DDP-trained) model and run many outer steps on islands whose per-island batch is
large (DiLoCo: 512 x 1024 tokens per island). So the bench first trains ``--warmup`` DDP steps of
the ``pretrain`` recipe on the bundled corpus (Shakespeare + King James Bible) once, at the
recipe's batch (``--warmup-batch-size`` rows) and peak LR held constant, and every method continues
from that model (``model.init_from``; fresh optimizer, the recipe's warm-up + cosine schedule over
``--steps``): the same model, the same rows in the same order and the same number of steps (so the
same tokens), on ``--replicas`` gloo ranks, ``--global-batch-size`` rows per step in all (32: 16
rows per island, 4x the recipe's per-rank batch, so that an island's inner step is nearer a DDP
step; the probes in docs/benchmarks.md show the gap to DDP shrinking with the per-island batch):

- ``ddp``: gradients all-reduced every step (``strategy=ddp``), the recipe's AdamW unchanged;
- ``diloco10``, ``diloco50``, ``diloco100``: DiLoCo, H = 10, 50, 100, outer Nesterov SGD lr 0.7
  (the paper's) with momentum 0.5 (``OUTER``; the paper's 0.9 is worse here, see ``OUTER``);
- ``desloc``: DES-LOC with K_x / K_u / K_v = 16 / 48 / 96;
- ``local_adam``: Local Adam, parameters and both moments every 16 steps;
- ``daso``: DASO (Coquelin et al. 2022) with B = 4, S = 1 and bf16 messages, no warm-up and a fixed
  period (the `daso` preset's plateau rule off): one eighth of DDP's bytes. Its last sum is sent at
  the last step and never merged, so its final loss is the islands' token-weighted mean.
- ``ist``: Independent Subnet Training (Yuan et al. 2022; the ``ist`` preset, L = 10): each island
  trains half of every MLP's hidden units, reassembled every 10 steps. Its steps are cheaper than
  DDP's, so IST is also compared at equal wall-clock time: after the equal-steps run, a second IST
  run (``ist_time``) gets the steps that DDP's training time buys at IST's measured tokens/s
  (rounded down to a multiple of L; the LR schedule spans its own steps), or at ``--ist-time-ratio``
  (a throughput ratio measured elsewhere: on shared cores one run's tokens/s is noisy).

Bytes are bytes each rank sends to the other replicas over the whole run, counted as a ring
all-reduce (2 (n - 1) / n x message bytes, `strategies.local_sgd.allreduce_bytes_sent`): for the
local-SGD runs as logged by the plugin, for DDP one fp32 all-reduce of every gradient per step.
``--steps`` is a multiple of every sync period of the methods run (2400 = lcm(100, 96): 48 outer
steps at H = 50, 24 at H = 100, every DES-LOC period a whole number of times), so every method ends
right after a parameter average and the final validation loss is that of one model shared by all
replicas. Ratios are to DDP (loss ratio > 1: worse than DDP).

Invocations::

    OMP_NUM_THREADS=1 python bench/local_sgd.py                      # CPU, nano: ~1 h on 2 contended cores
    python bench/local_sgd.py --warmup-dir /tmp/w2400 --steps 500 --methods ddp diloco50  # probe; warm-up kept
    python bench/local_sgd.py --warmup 0 --steps 400 --global-batch-size 8 --methods ddp diloco10 diloco50
    python bench/local_sgd.py --warmup 400 --steps 400 --methods ddp daso   # DASO against DDP, ~10 minutes
    python bench/local_sgd.py --methods ddp daso --lr ddp=0.006 --lr daso=0.012  # each at its tuned rate
    python bench/local_sgd.py --model tiny --seq-len 256 --global-batch-size 8 --warmup 0 --steps 400 \
        --methods ddp ist                                           # IST on the pretrain recipe's sizes
    python bench/local_sgd.py --methods ddp --extra "nesterov09=strategy=diloco strategy.local_sgd.sync_every=50
        strategy.local_sgd.outer_optimizer.momentum=0.9"              # another setting, next to DDP

``--warmup-dir DIR`` keeps the warm-up run in DIR and reuses it when DIR already holds one (it does
not check that the warm-up's flags match this invocation's: that is the caller's to keep).
The last line is ``RESULT diloco50_bytes_ratio=<x> diloco50_loss_ratio=<y> diloco100_bytes_ratio=
diloco100_loss_ratio= desloc_bytes_ratio=<z> desloc_loss_ratio=<w>`` (and ``daso_bytes_ratio``,
``daso_loss_ratio`` when daso runs; ``ist_bytes_ratio``, ``ist_loss_ratio`` (both of the equal
wall-clock run) and ``ist_tokens_per_s_ratio``, ``ist_steps_loss_ratio`` (equal steps) when ist
runs), for the methods run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: the ranks share the cores

from strategies.local_sgd import allreduce_bytes_sent  # noqa: E402
from strategies.runtime.launch import LAUNCH_ENV  # noqa: E402
from trainer.build import build_run  # noqa: E402
from trainer.compose import compose  # noqa: E402
from trainer.config import validate  # noqa: E402

# DiLoCo's outer step: Nesterov lr 0.7 as in the paper, momentum 0.5 instead of its 0.9 (the
# probes in docs/benchmarks.md: with 2 islands and an inner AdamW at DDP's own lr, 0.9 amplifies the
# noisy pseudo-gradient ~lr / (1 - momentum) = 7x and ends above plain averaging).
OUTER = ["strategy.local_sgd.outer_optimizer.lr=0.7", "strategy.local_sgd.outer_optimizer.momentum=0.5"]
METHODS = {
    "ddp": ["strategy=ddp"],
    "diloco10": ["strategy=diloco", "strategy.local_sgd.sync_every=10", *OUTER],
    "diloco50": ["strategy=diloco", "strategy.local_sgd.sync_every=50", *OUTER],
    "diloco100": ["strategy=diloco", "strategy.local_sgd.sync_every=100", *OUTER],
    "desloc": ["strategy=desloc"],  # 16 / 48 / 96
    "local_adam": ["strategy=local_adam"],  # 16
    # DASO with one rank per group (the bench's replicas): sums every 4 steps in bf16, merged 1 step late.
    "daso": [
        "strategy=daso",
        "strategy.dp_shard=1",
        "strategy.local_sgd.warmup_steps=0",
        "strategy.local_sgd.adaptive=false",
    ],  # fmt: skip
    "ist": ["strategy=ist"],  # L = 10, half of every MLP's units per island
}
# Steps between the syncs each method's final loss and bytes depend on (DES-LOC: its slowest state).
SYNC_PERIOD = {
    "ddp": 1,
    "diloco10": 10,
    "diloco50": 50,
    "diloco100": 100,
    "desloc": 96,
    "local_adam": 16,
    "daso": 4,
    "ist": 10,
}
DEFAULT_METHODS = ["ddp", "diloco50", "diloco100", "desloc", "local_adam"]
# --lr METHOD=LR: a method's own AdamW rate (its tuned one), the warm-up keeps the recipe's.
RATES: dict[str, float] = {}


def train(method: str, args: argparse.Namespace, run_dir: Path, *, steps: int, init_from: str | None) -> dict[str, Any]:
    """One run in forked gloo ranks; returns rank 0's final validation loss, bytes sent and wall time."""
    cfg = compose(
        "pretrain",
        [
            *METHODS["ddp" if method == "warmup" else method],
            # The warm-up holds the peak LR (after its 20 warm-up steps); every continuation then
            # runs the recipe's schedule (20 steps back up to the same peak, cosine to 0.1x): no
            # jump from a decayed LR back to the peak.
            *(["scheduler=constant"] if method == "warmup" else []),
            *([f"optim.lr={RATES[method]}"] if method in RATES else []),
            f"model={args.model}",
            # The same data seed as the warm-up: the BPE is trained on the seed's training split,
            # so another seed would be another tokenizer than the one the warm-up model learned.
            f"model.init_from={init_from}" if init_from else "model.init_from=null",
            f"data.seq_len={args.seq_len}",
            f"data.eval_rows={args.eval_rows}",
            f"train.global_batch_size={args.warmup_batch_size if method == 'warmup' else args.global_batch_size}",
            "train.eval_every=0",  # validation at step 0 and at the end only
            f"trainer.max_steps={steps}",
            f"trainer.devices={args.replicas}",
            "trainer.enable_progress_bar=false",
            f"trainer.log_every_n_steps={steps}",
            "logger=none",
            "~callbacks.plots",
            f"callbacks.checkpoint.every_n_steps={steps if method == 'warmup' else 0}",
            "strategy.timeout_s=300",
        ],
    )
    trainer, task, data = build_run(cfg, run_dir, validate(cfg), launcher="fork")
    start = time.perf_counter()
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
            os.environ.pop(key, None)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [h for h in task.history if "loss" in h]
    num_params = sum(p.numel() for p in task.model.parameters())
    if "comm/bytes_sent_total" in steps[-1]:  # a local-SGD plugin's own count
        sent = steps[-1]["comm/bytes_sent_total"]
    else:  # DDP (also an --extra arm of strategy=ddp): fp32 gradients, every step
        sent = len(steps) * allreduce_bytes_sent(4 * num_params, args.replicas)
    return {
        "val_loss": [h["val_loss"] for h in task.history if "val_loss" in h][-1],
        "val_loss_start": [h["val_loss"] for h in task.history if "val_loss" in h][0],
        "bytes": sent,
        "steps": len(steps),
        "params": num_params,
        "wall_s": time.perf_counter() - start,
        "tokens_per_s": summary["tokens_per_s"],  # after each rank's first step (trainer.callbacks.summary)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=32, help="rows per step, all replicas together")
    parser.add_argument("--warmup-batch-size", type=int, default=8, help="rows per warm-up step (the recipe's)")
    parser.add_argument("--eval-rows", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2400, help="DDP steps every method starts from (0: random init)")
    parser.add_argument("--steps", type=int, default=2400, help="steps of each method after the warm-up")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--warmup-dir",
        type=Path,
        default=None,
        help="keep the warm-up run here and reuse it when it is already there (probes from one warm-up)",
    )
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument(
        "--ist-time-ratio",
        type=float,
        default=None,
        help="IST's tokens/s over DDP's for the equal-time run (default: as measured in this invocation)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="one more run: a name, '=', then its space-separated strategy overrides",
    )
    parser.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="METHOD=LR",
        help="a method's own AdamW rate (e.g. each method's tuned one: --lr ddp=0.006 --lr daso=0.012); "
        "default: the recipe's",
    )
    args = parser.parse_args()
    for item in args.lr:
        name, _, rate = item.partition("=")
        if name not in METHODS:
            sys.exit(f"--lr {item}: {name} is not a method ({', '.join(METHODS)})")
        RATES[name] = float(rate)
    for extra in args.extra:
        name, _, overrides = extra.partition("=")
        METHODS[name] = overrides.split()
        SYNC_PERIOD[name] = 1  # the user's run: its period is theirs to choose
        args.methods.append(name)
    period = math.lcm(*(SYNC_PERIOD[m] for m in args.methods))
    if args.steps % period:
        sys.exit(f"--steps must be a multiple of {period} (every sync period of the methods run)")
    if "ddp" not in args.methods:
        sys.exit("--methods must include ddp (the reference)")

    results = {}
    with tempfile.TemporaryDirectory(prefix="plait-bench-local-sgd-") as tmp:
        init_from = None
        if args.warmup:
            warm_dir = args.warmup_dir or Path(tmp) / "warmup"
            if not (warm_dir / "summary.json").exists():
                warm = train("warmup", args, warm_dir, steps=args.warmup, init_from=None)
                print(
                    f"warm-up (DDP, {args.warmup} steps): val_loss={warm['val_loss']:.4f} wall={warm['wall_s']:.0f}s",
                    flush=True,
                )
            init_from = str(warm_dir)
        runs = [(m, args.steps) for m in sorted(args.methods, key=lambda m: m != "ddp")]  # DDP first
        while runs:
            method, steps = runs.pop(0)
            results[method] = train(
                method.removesuffix("_time"), args, Path(tmp) / method, steps=steps, init_from=init_from
            )
            r = results[method]
            print(
                f"{method}: {steps} steps, val_loss={r['val_loss_start']:.4f} -> {r['val_loss']:.4f} "
                f"bytes_per_rank={r['bytes']:.4g} tokens/s={r['tokens_per_s']} wall={r['wall_s']:.0f}s",
                flush=True,
            )
            if method == "ist":  # then at DDP's training time: the steps its tokens/s buys in that time
                ratio = args.ist_time_ratio or r["tokens_per_s"] / results["ddp"]["tokens_per_s"]
                runs.append(("ist_time", int(args.steps * ratio) // SYNC_PERIOD["ist"] * SYNC_PERIOD["ist"]))

    ddp = results["ddp"]
    print(
        f"\n{args.replicas} replicas, model={args.model} ({ddp['params']} parameters), {args.warmup} DDP warm-up steps of {args.warmup_batch_size} x {args.seq_len}, "
        f"then {args.steps} steps of {args.global_batch_size} x {args.seq_len} tokens per method, AdamW inner\n"
    )
    print("| method | final val loss | loss / DDP | bytes sent per rank | bytes / DDP | wall (s) |")
    print("|---|---|---|---|---|---|")
    for method, r in results.items():
        print(
            f"| {method} | {r['val_loss']:.4f} | {r['val_loss'] / ddp['val_loss']:.4f} | {r['bytes']:.4g} | "
            f"{r['bytes'] / ddp['bytes']:.4f} | {r['wall_s']:.0f} |"
        )
    headline = []
    for method in ("diloco50", "diloco100", "desloc", "daso"):
        if method in results:
            r = results[method]
            headline += [
                f"{method}_bytes_ratio={r['bytes'] / ddp['bytes']:.5f}",
                f"{method}_loss_ratio={r['val_loss'] / ddp['val_loss']:.4f}",
            ]
    if "ist_time" in results:
        timed, steps = results["ist_time"], results["ist"]
        headline += [
            f"ist_bytes_ratio={timed['bytes'] / ddp['bytes']:.5f}",
            f"ist_loss_ratio={timed['val_loss'] / ddp['val_loss']:.4f}",
            f"ist_tokens_per_s_ratio={steps['tokens_per_s'] / ddp['tokens_per_s']:.4f}",
            f"ist_steps={timed['steps']}",
            f"ist_steps_loss_ratio={steps['val_loss'] / ddp['val_loss']:.4f}",
        ]
    print("RESULT " + " ".join(headline))


if __name__ == "__main__":
    main()
