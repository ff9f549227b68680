"""Golden runs: record the per-step metrics of fixed CLI runs, or compare a tree against a record.

Refactors keep numerics bitwise (torchtitan's rule): record on the commit before the change,
compare after it. Each run is the real CLI (``python -m trainer.cli``) on the bundled data for
10 optimizer steps with every step logged; compared are ``train/loss``, ``train/grad_norm``,
``train/lr`` and ``val/loss`` (bitwise: the values as written to metrics.csv).

Invocation (~10 minutes on 2 idle cores)::

    python bench/golden.py record /tmp/golden-before      # on the commit before the change
    python bench/golden.py compare /tmp/golden-before     # on the changed tree
    python bench/golden.py compare /tmp/golden-before --only pretrain,fsdp2

The last line is ``RESULT runs=<n> equal=<n> differ=<names>``; ``compare`` exits 1 if any run differs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = [
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "train.eval_every=5",
    "trainer.enable_progress_bar=false",
]

# name -> CLI arguments (recipe first). Every layout of the list, 10 steps each.
RUNS: dict[str, list[str]] = {
    "pretrain": ["pretrain"],
    "fsdp2": ["pretrain", "strategy=fsdp", "trainer.devices=2"],
    "fsdp_tp4": ["pretrain", "strategy=fsdp_tp", "trainer.devices=4"],
    "pp2_1f1b": ["pretrain", "strategy=pp", "trainer.devices=2"],
    "cp2_ring": ["pretrain", "strategy=cp", "strategy.context_parallel.mode=ring", "trainer.devices=2"],
    "diloco2": ["pretrain", "strategy=diloco", "strategy.local_sgd.sync_every=4", "trainer.devices=2"],
    "sft": ["sft"],
    "dpo": ["dpo"],
    # One mSFT search on the synthetic mixture: every roll-out's metrics.csv is compared.
    "msft": [
        "sft",
        "data=synthetic",
        "model=nano",
        "model.max_seq_len=64",
        "train.global_batch_size=16",
        "budget=msft",
        "budget.compute=0.5",
        "budget.eval_every=5",
        "budget.baseline=false",
    ],
}
KEYS = ("train/loss", "train/grad_norm", "train/lr", "val/loss")


def run_one(name: str, run_dir: Path) -> dict[str, dict[str, str]]:
    """Runs one golden config; returns ``{"<metrics.csv relative path>:<step>": {key: value}}``."""
    args = RUNS[name] + ([] if name == "msft" else COMMON) + [f"run_dir={run_dir}"]
    if name == "msft":
        args += ["trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args], capture_output=True, text=True, env=env, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    rows: dict[str, dict[str, str]] = {}
    for path in sorted(run_dir.rglob("metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                values = {k: row[k] for k in KEYS if row.get(k) not in (None, "")}
                if values:
                    rows[f"{path.relative_to(run_dir)}:{row['step']}"] = {
                        **rows.get(f"{path.relative_to(run_dir)}:{row['step']}", {}),
                        **values,
                    }
    if not rows:
        raise RuntimeError(f"{name}: no metrics rows under {run_dir}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("record", "compare"))
    parser.add_argument("record_dir", type=Path)
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    args.record_dir.mkdir(parents=True, exist_ok=True)
    differ: list[str] = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"plait-golden-{name}-") as tmp:
            rows = run_one(name, Path(tmp) / "run")
        path = args.record_dir / f"{name}.json"
        if args.mode == "record":
            path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
            print(f"{name}: recorded {len(rows)} rows -> {path}", flush=True)
            continue
        golden = json.loads(path.read_text())
        diffs = [
            f"  {row} {key}: golden {golden.get(row, {}).get(key)} now {rows.get(row, {}).get(key)}"
            for row in sorted(set(golden) | set(rows))
            for key in KEYS
            if golden.get(row, {}).get(key) != rows.get(row, {}).get(key)
        ]
        finite = all(math.isfinite(float(v)) for r in rows.values() for v in r.values())
        print(
            f"{name}: {'bitwise equal' if not diffs else f'{len(diffs)} values differ'} ({len(rows)} rows{'' if finite else ', NON-FINITE'})",
            flush=True,
        )
        if diffs:
            differ.append(name)
            print("\n".join(diffs[:20]), flush=True)
    equal = len(names) - len(differ) if args.mode == "compare" else 0
    print(f"RESULT runs={len(names)} equal={equal} differ={','.join(differ) or 'none'}")
    if differ:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
