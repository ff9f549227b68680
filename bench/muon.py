"""Muon against AdamW at equal steps on the default pretrain recipe: final validation loss of each.

The ``pretrain`` recipe as it is (tiny Llama, bundled Shakespeare + King James Bible corpus, 8 rows of
256 tokens per step, warm-up + cosine, clipping at 1.0) with ``optim=adamw`` and with ``optim=muon``
(Muon on the blocks' matrices, AdamW on the embedding, head and norms; Moonlight's update scale,
so AdamW's rates carry over). Each optimizer's peak learning rate is tuned by a small sweep: one
run of ``--steps`` steps (the recipe's schedule over those steps) at each rate of ``--adamw-lrs``
and ``--muon-lrs``; each optimizer's figure is its best rate's (all rates are printed). Every run
sees the same rows in the same order from the same initial weights.

Invocations::

    python bench/muon.py                                          # 6 x 400 steps: ~20 min on 2 quiet cores
    python bench/muon.py --steps 100 --adamw-lrs 3e-3 6e-3 --muon-lrs 3e-3 6e-3   # shorter
    python bench/muon.py --extra optim.ns_dtype=float32           # more overrides for every run
    python bench/muon.py --steps 60 --jobs 4 --adamw-lrs 3e-3 6e-3 --muon-lrs 3e-3 6e-3   # 4 runs at once

The last line is ``RESULT muon_val_loss=<x> adamw_val_loss=<y> muon_lr=<a> adamw_lr=<b> muon_over_adamw=<x/y>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# One thread per run: Newton-Schulz's small matmuls on 2 threads of a loaded machine wait on each
# other (a 512 x 192 iteration: 37 ms on 1 thread, 480 ms on 2 under load 10), and --jobs runs share the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def train(optim: str, lr: float, steps: int, root: Path, extra: list[str]) -> dict[str, float]:
    """One ``plait pretrain`` run; its final validation loss and wall time (``summary.json``)."""
    run_dir = root / f"{optim}_lr{lr:g}_s{steps}"
    args = [f"optim={optim}", f"optim.lr={lr}", f"trainer.max_steps={steps}", "logger=none", "~callbacks.plots"]
    command = [sys.executable, "-m", "trainer.cli", "pretrain", *args, *extra, f"run_dir={run_dir}"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"val_loss": summary["final_val_loss"], "wall_s": summary["wall_time_s"]}
    print(
        f"{optim:6s} lr={lr:<8g} steps={steps:4d} val_loss={row['val_loss']:.4f} wall={row['wall_s']:.0f}s", flush=True
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="steps of every run (the recipe's 400)")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (their wall times then overlap)")
    args = parser.parse_args()
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="plait_muon_") as tmp:
        root = Path(tmp)
        runs = [(optim, lr) for optim, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)) for lr in lrs]
        with ThreadPoolExecutor(args.jobs) as pool:
            losses = list(pool.map(lambda run: train(*run, args.steps, root, args.extra)["val_loss"], runs))
        best = {}
        for (optim, lr), loss in zip(runs, losses):
            if optim not in best or loss < best[optim][1]:
                best[optim] = (lr, loss)
    print(f"bench time {time.time() - start:.0f}s")
    (muon_lr, muon), (adamw_lr, adamw) = best["muon"], best["adamw"]
    print(
        f"RESULT muon_val_loss={muon:.4f} adamw_val_loss={adamw:.4f} muon_lr={muon_lr:g} "
        f"adamw_lr={adamw_lr:g} muon_over_adamw={muon / adamw:.4f} steps={args.steps}"
    )


if __name__ == "__main__":
    main()
