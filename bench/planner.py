"""Planner estimate vs measured: memory bytes and step-time ranking of six layouts on this CPU.

For each layout (DDP, FSDP2, FSDP4, TP2, PP2, CP2; 2 or 4 forked gloo ranks, one thread each)
the script trains a small Llama for a few AdamW steps through plait (`MemoryProbe` and `StepTimer`
callbacks) and compares with the planner's predictions for the same composed config:

- ``mem_exact``: predicted parameter, gradient and optimizer bytes equal the measured storages on
  every rank;
- ``act_err_max``: the largest relative error of predicted vs measured saved-for-backward bytes
  per micro-batch (any rank);
- ``spearman``: rank correlation of predicted vs measured step time over the six layouts. The
  measured time is the fastest step after the first two: on a machine shared with other jobs the
  slow steps measure the other jobs, the fastest the layout. The planner's cluster is ``cluster=cpu`` calibrated on this
  machine (`strategies.planner.calibrate`) at 2 and at 4 ranks, after the runs.

Invocation (about 3 minutes on 2 idle cores)::

    OMP_NUM_THREADS=1 python bench/planner.py
    OMP_NUM_THREADS=1 python bench/planner.py --steps 10 --model tiny --seq-len 128

The last line is ``RESULT mem_exact=<true|false> act_err_max=<x> spearman=<y>``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from strategies.planner.memory import predict_rank
from strategies.planner.time import predict_time
from strategies.runtime.launch import LAUNCH_ENV
from trainer.build import build_run
from trainer.compose import compose
from trainer.config import validate
from trainer.planning import calibrate, cluster_from_config, planner_inputs

LAYOUTS = {
    "ddp2": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp", "trainer.devices=2"],
    "fsdp4": ["strategy=fsdp", "trainer.devices=4"],
    "tp2": ["strategy=tp", "trainer.devices=2"],
    "pp2": ["strategy=pp", "trainer.devices=2"],
    "cp2": ["strategy=cp", "trainer.devices=2"],
}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (no ties expected)."""

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def run_layout(name: str, overrides: list[str], args: argparse.Namespace, root: Path) -> dict:
    micro = args.micro_batch
    devices = int(next(o for o in overrides if o.startswith("trainer.devices=")).split("=")[1])
    dp = devices if "strategy=ddp" in overrides or "strategy=fsdp" in overrides else 1
    cfg = compose("pretrain", [
        f"+callbacks.mem.num_microbatches={args.batch // (dp * micro)}",
        f"model={args.model}", f"data.seq_len={args.seq_len}", "data.eval_rows=8", f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={micro}", "train.eval_every=0", f"trainer.max_steps={args.steps}",
        "cluster=cpu", "trainer.enable_progress_bar=false", "logger=none", "~callbacks.plots", "~callbacks.checkpoint",
        "strategy.timeout_s=300", "+callbacks.mem._target_=strategies.planner.measure.MemoryProbe",
        "+callbacks.timer._target_=strategies.planner.measure.StepTimer", *overrides,
    ])  # fmt: skip
    run = validate(cfg)
    shape, layout, work = planner_inputs(cfg, run)
    assert cfg.callbacks.mem.num_microbatches == work.microbatches(layout)
    run_dir = root / name
    trainer, task, data = build_run(cfg, run_dir, run, launcher="fork")
    try:
        trainer.fit(task, datamodule=data)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    measured = [json.loads((run_dir / f"memory_rank{r}.json").read_text()) for r in range(layout.world_size)]
    times = json.loads((run_dir / "step_times.json").read_text())[2:]  # after warm-up
    return {"cfg": cfg, "shape": shape, "layout": layout, "work": work, "measured": measured, "step_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="plait-planner-bench-"))
    results = {name: run_layout(name, overrides, args, root) for name, overrides in LAYOUTS.items()}
    first = next(iter(results.values()))
    # Calibrated once per world size: links between 4 ranks on fewer cores are not those of 2.
    clusters = {r["layout"].world_size: calibrate(cluster_from_config(r["cfg"])) for r in results.values()}
    shape = first["shape"]
    mem_exact, act_err_max, predicted, measured = True, 0.0, [], []
    print(
        f"{'layout':<8} {'rank':>4} {'params':>10} {'grads':>10} {'optim':>10} {'act pred':>10} {'act meas':>10} {'err':>7}"
    )
    for name, r in results.items():
        layout, work = r["layout"], r["work"]
        for rank, m in enumerate(r["measured"]):
            p = predict_rank(shape, layout, work, rank, device="cpu")
            exact = (p.params, p.grads, p.optimizer) == (m["params"], m["grads"], m["optimizer"])
            err = abs(p.activations_per_microbatch / m["activations"] - 1)
            mem_exact &= exact
            act_err_max = max(act_err_max, err)
            print(
                f"{name:<8} {rank:>4} {m['params']:>10} {m['grads']:>10} {m['optimizer']:>10} "
                f"{p.activations_per_microbatch:>10} {m['activations']:>10} {err:>7.4f}{'' if exact else '  STATES DIFFER'}"
            )
        step = predict_time(shape, layout, work, clusters[layout.world_size])
        predicted.append(step.total)
        measured.append(r["step_s"])
    for size, cluster in clusters.items():
        print(f"\ncalibrated, {size} ranks: {cluster}")
    print(f"\n{'layout':<8} {'predicted s':>12} {'measured s':>11}")
    for (name, r), p in zip(results.items(), predicted):
        print(f"{name:<8} {p:>12.4f} {r['step_s']:>11.4f}")
    rho = spearman(predicted, measured)
    print(f"RESULT mem_exact={str(mem_exact).lower()} act_err_max={act_err_max:.4f} spearman={rho:.3f}")


if __name__ == "__main__":
    main()
