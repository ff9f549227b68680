"""Fault trial of torchft replica groups (`strategies/fault_tolerance.py`, strategy=ft): a group killed
with SIGKILL mid-run, restarted, recovered from the healthy group, rejoined.

Three runs of the pretrain recipe's nano model on CPU, each group one process (gloo):
1. plain HSDP, 2 replicas on one process group (strategy=hsdp dp_shard=1 dp_replicate=2): the reference;
2. 2 torchft replica groups without faults: per-step train loss and final weights against 1;
3. 2 replica groups, group 1 killed with SIGKILL at a random step; the script restarts it (a fresh
   process, a new run directory), it recovers the current state from group 0 and rejoins; group 0
   trains on alone meanwhile, without a restart.
Prints tokens/s and the final train/validation loss of runs 2 and 3, and as its last line
``RESULT hsdp_survived=1 hsdp_rejoined=1 hsdp_params_equal=1 ...`` (1: yes, 0: no).

    python bench/ft.py                 # ~2 minutes on 2 cores
    python bench/ft.py --steps 60 --seed 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Manager log every quorum at info
SMALL = [
    "model=nano",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "~callbacks.plots",
    "callbacks.hf_export.at_end=true",  # the final weights, to compare the groups
    "callbacks.checkpoint.every_n_steps=0",
]


def plait(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``plait pretrain args`` in a child process (its output in ``log``)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    environ.update(env)
    cmd = [sys.executable, "-m", "trainer.cli", "pretrain", *SMALL, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=log.open("w"), stderr=subprocess.STDOUT)


def group(g: int, lighthouse: str, run_dir: Path, steps: int, out: Path, devices: int = 1) -> subprocess.Popen:
    """Replica group ``g`` of a 2-group torchft run (``devices`` processes: FSDP inside the group)."""
    args = [
        "strategy=ft",
        f"trainer.devices={devices}",
        f"trainer.max_steps={steps}",
        f"strategy.fault_tolerance.replica_group={g}",
        f"strategy.fault_tolerance.lighthouse={lighthouse}",
        "strategy.fault_tolerance.timeout_s=10",
        f"run_dir={run_dir}",
    ]
    return plait(args, out / f"{run_dir.name}.log", RUST_LOG="warn")


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss by step from the run's metrics.csv."""
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def last_step(run_dir: Path) -> int:
    """The last step in the run's metrics.csv so far (-1 before the first)."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return -1
    with path.open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return max(steps, default=-1)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights (the run's Hugging Face export)."""
    return {k: v for f in sorted((run_dir / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), "the two runs hold different tensors"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def lighthouse(min_replicas: int, join_timeout_ms: int):
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=2000
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=None, help="of the kill step (default: random)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--devices", type=int, default=1, help="processes per group (FSDP inside it; HSDP dp_shard)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plait-ft-"))
    out.mkdir(parents=True, exist_ok=True)
    kill_at = random.Random(args.seed).randrange(args.steps // 8, args.steps // 4)  # the restart takes ~10 s
    print(f"runs in {out}; group 1 is killed after step {kill_at} of {args.steps}", flush=True)

    # 1. plain HSDP: 2 replicas of one process each, one process group
    ref = out / "hsdp"
    hsdp = ["strategy=hsdp", f"strategy.dp_shard={args.devices}", f"trainer.devices={2 * args.devices}"]
    proc = plait([*hsdp, f"trainer.max_steps={args.steps}", f"run_dir={ref}"], out / "hsdp.log")
    assert proc.wait() == 0, f"the HSDP run failed: {out / 'hsdp.log'}"

    # 2. torchft, no faults: the first quorum waits for both groups
    server = lighthouse(min_replicas=2, join_timeout_ms=60_000)
    runs = [out / f"nofault_g{g}" for g in range(2)]
    procs = [group(g, server.address(), runs[g], args.steps, out, args.devices) for g in range(2)]
    codes = [p.wait() for p in procs]
    server.shutdown()
    assert codes == [0, 0], f"the unfaulted groups exited {codes}: {out}"
    ref_losses, ft_losses = losses(ref), losses(runs[0])
    loss_gap = max(abs(ref_losses[s] - ft_losses[s]) for s in ref_losses)
    nofault_equal = max_diff(weights(runs[0]), weights(runs[1])) == 0.0
    ref_gap = max_diff(weights(ref), weights(runs[0]))
    print(
        f"no faults: train loss vs HSDP max |diff| {loss_gap:.2e}; final weights vs HSDP max |diff| {ref_gap:.2e}; groups equal: {nofault_equal}"
    )

    # 3. torchft, group 1 killed and restarted: quorums without it after 2 s of silence
    server = lighthouse(min_replicas=1, join_timeout_ms=5_000)
    faulted = [out / "fault_g0", out / "fault_g1"]
    procs = [group(g, server.address(), faulted[g], args.steps, out, args.devices) for g in range(2)]
    while last_step(faulted[1]) < kill_at:
        if procs[1].poll() is not None:
            raise SystemExit(f"group 1 ended before the kill: {out}")
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    killed_at = last_step(faulted[1])
    before = last_step(faulted[0])
    time.sleep(3.0)  # the survivor trains alone meanwhile
    survived = procs[0].poll() is None and last_step(faulted[0]) > before
    rejoined_run = out / "fault_g1_restart"
    restart = group(1, server.address(), rejoined_run, args.steps, out, args.devices)
    codes = [procs[0].wait(), restart.wait()]
    server.shutdown()
    first_step = min(losses(rejoined_run), default=-1)
    rejoined = codes[1] == 0 and first_step > killed_at
    params_equal = codes == [0, 0] and max_diff(weights(faulted[0]), weights(rejoined_run)) == 0.0
    alone = [s for s in range(killed_at + 1, first_step)]
    print(
        f"fault: group 1 killed after step {killed_at}; group 0 went on alone for {len(alone)} steps, "
        f"group 1 restarted and rejoined at step {first_step}; exit codes {codes}; final weights equal: {params_equal}"
    )
    for name, run in (("no faults", runs[0]), ("fault", faulted[0])):
        s = summary(run)
        print(
            f"{name}: group 0 tokens/s {s['tokens_per_s']:.1f}, final train loss {s['final_train_loss']:.4f}, final val loss {s['final_val_loss']:.4f}"
        )
    print(
        f"RESULT hsdp_survived={int(survived)} hsdp_rejoined={int(rejoined)} hsdp_params_equal={int(params_equal)} "
        f"nofault_equals_hsdp={int(loss_gap <= 1e-6 and ref_gap <= 1e-6)} nofault_groups_equal={int(nofault_equal)}"
    )


if __name__ == "__main__":
    main()
