"""float8 training vs bf16 at equal steps: final validation loss and wall time of the default pretrain recipe.

Two runs of the ``pretrain`` recipe (tiny Llama, the bundled corpus, AdamW, warm-up + cosine), the
same seed, rows and steps, one after the other in this process: ``bf16`` (``trainer.precision=
bf16-mixed``: CPU autocast) and ``float8`` (the same, plus ``strategy.float8.recipe=tensorwise``:
every Linear of the blocks computes its matmuls from float8 casts, the LM head in bf16; emulated on
CPU, `strategies.float8`). The float8 path on CPU is torchao's emulation (float8 casts, then the fp32
product of the dequantized values), so its wall time measures the casts' cost, not a float8 speed-up:
only a GPU of SM 8.9+ runs float8 kernels. The loss ratio is what carries over to a GPU.

Invocations::

    OMP_NUM_THREADS=2 python bench/float8.py                   # 200 steps each (the issue's figure)
    python bench/float8.py --steps 50 --recipe rowwise         # a quick check of the other recipe
    python bench/float8.py --power-of-2-scales                 # tensorwise with power-of-2 scales (what TP needs)
    python bench/float8.py --arms float8                       # one arm (no RESULT line): runs side by side
    python bench/float8.py --seed 1                            # another seed for both arms (init, data order, split)

The last line is ``RESULT float8_over_bf16_val_loss=<float8 / bf16 final validation loss>
float8_val_loss=<x> bf16_val_loss=<y> float8_wall_s=<a> bf16_wall_s=<b>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from strategies.runtime.launch import LAUNCH_ENV
from trainer.build import build_data, build_run
from trainer.compose import compose
from trainer.config import validate


def train(overrides: list[str], run_dir: Path, steps: int) -> dict[str, Any]:
    """One run of the pretrain recipe with ``overrides``; its final validation loss and wall time."""
    cfg = compose(
        "pretrain",
        [
            *overrides,
            "trainer.precision=bf16-mixed",
            f"trainer.max_steps={steps}",
            "trainer.enable_progress_bar=false",
            "logger=none",
            "~callbacks.plots",
            "callbacks.checkpoint.every_n_steps=0",
        ],
    )
    trainer, task, data = build_run(cfg, run_dir, validate(cfg))  # one process: trains in this one
    start = time.perf_counter()
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
            os.environ.pop(key, None)
    return {
        "val_loss": [h["val_loss"] for h in task.history if "val_loss" in h][-1],
        "steps": len([h for h in task.history if "loss" in h]),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None, help="seed= of both arms (default: the recipe's)")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--arms", nargs="+", default=["bf16", "float8"], choices=["bf16", "float8"])
    parser.add_argument(
        "--power-of-2-scales", action="store_true", help="strategy.float8.round_scales_to_power_of_2=true"
    )
    args = parser.parse_args()
    float8 = [f"strategy.float8.recipe={args.recipe}"]
    if args.power_of_2_scales:
        float8.append("strategy.float8.round_scales_to_power_of_2=true")
    common = [] if args.seed is None else [f"seed={args.seed}"]
    build_data(compose("pretrain", common)).prepare()  # tokenizer and rows cached: neither arm's wall time holds them
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, overrides in [("bf16", []), ("float8", float8)]:
            if arm in args.arms:
                results[arm] = train([*common, *overrides], Path(tmp) / arm, args.steps)
                print(f"{arm}: {results[arm]}", flush=True)
    if len(results) < 2:
        return  # one arm (--arms): its line above
    f8, bf16 = results["float8"], results["bf16"]
    print(
        f"{args.steps} steps, {' '.join(float8)}: val loss float8 {f8['val_loss']:.4f} vs bf16 {bf16['val_loss']:.4f}; "
        f"wall {f8['wall_s']:.0f} s vs {bf16['wall_s']:.0f} s (float8 emulated on CPU)"
    )
    print(
        f"RESULT float8_over_bf16_val_loss={f8['val_loss'] / bf16['val_loss']:.4f} "
        f"float8_val_loss={f8['val_loss']:.4f} bf16_val_loss={bf16['val_loss']:.4f} "
        f"float8_wall_s={f8['wall_s']:.1f} bf16_wall_s={bf16['wall_s']:.1f}"
    )


if __name__ == "__main__":
    main()
