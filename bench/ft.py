"""Fault trial of torchft replica groups (`strategies/fault_tolerance.py`): a group killed with SIGKILL
mid-run, restarted, recovered from the healthy group, rejoined; for HSDP (strategy=ft) and for DiLoCo
(strategy=ft_diloco, one island per group).

For each kind, three runs of the pretrain recipe's nano model on CPU (gloo), groups of ``--devices``
processes (FSDP inside a group):
1. the same algorithm on one process group (strategy=hsdp, or strategy=diloco with 2 islands): the reference;
2. 2 torchft replica groups without faults: final weights against 1 and between the groups;
3. 2 replica groups, group 1 killed with SIGKILL at a random step; the script starts it again (a fresh
   process, a new run directory), it takes group 0's state at its first quorum (DiLoCo: at the start
   of group 0's next outer round) and rejoins; group 0 trains on alone meanwhile, without a restart.
Prints tokens/s and the final train/validation loss of runs 2 and 3, and as its last line
``RESULT hsdp_survived=1 hsdp_rejoined=1 hsdp_params_equal=1 ... diloco_survived=1 ...`` (1: yes, 0: no).

    python bench/ft.py                                 # ~15 minutes on 2 shared cores
    python bench/ft.py --kinds diloco --sync-every 10 --seed 3
    python bench/ft.py --devices 2 --kinds hsdp        # FSDP over 2 processes inside each group
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


def group(
    g: int, lighthouse: str, run_dir: Path, steps: int, out: Path, devices: int, extra: list[str]
) -> subprocess.Popen:
    """Replica group ``g`` of a 2-group torchft run (``devices`` processes: FSDP inside the group)."""
    args = [
        *extra,
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


def trial(kind: str, args: argparse.Namespace, out: Path, kill_at: int) -> dict[str, int]:
    """One kind's three runs (``kind``: "hsdp": strategy=ft against strategy=hsdp; "diloco":
    strategy=ft_diloco against strategy=diloco, both with H = ``--sync-every``); its RESULT fields."""
    out = out / kind
    out.mkdir(parents=True, exist_ok=True)
    devices, steps = args.devices, args.steps
    micro = f"train.micro_batch_size={4 // devices}"
    diloco = [f"strategy.local_sgd.sync_every={args.sync_every}"] if kind == "diloco" else []

    # 1. the same algorithm on one process group: 2 replicas (islands) of `devices` processes each
    ref = out / "reference"
    if kind == "hsdp":
        layout = ["strategy=hsdp", f"strategy.dp_shard={devices}"]
    else:
        layout = ["strategy=diloco", f"strategy.dp_shard={devices}", *diloco]
    proc = plait(
        [*layout, f"trainer.devices={2 * devices}", micro, f"trainer.max_steps={steps}", f"run_dir={ref}"],
        out / "reference.log",
    )
    assert proc.wait() == 0, f"the reference run failed: {out / 'reference.log'}"

    preset = "ft" if kind == "hsdp" else "ft_diloco"

    def start(g: int, run_dir: Path, address: str, restarted: bool = False) -> subprocess.Popen:
        again = ["strategy.fault_tolerance.restarted=true"] if restarted else []
        return group(g, address, run_dir, steps, out, devices, [f"strategy={preset}", micro, *diloco, *again])

    # 2. torchft, no faults: the first quorum waits for both groups
    server = lighthouse(min_replicas=2, join_timeout_ms=60_000)
    runs = [out / f"nofault_g{g}" for g in range(2)]
    procs = [start(g, runs[g], server.address()) for g in range(2)]
    codes = [p.wait() for p in procs]
    server.shutdown()
    assert codes == [0, 0], f"the unfaulted groups exited {codes}: {out}"
    nofault_equal = max_diff(weights(runs[0]), weights(runs[1])) == 0.0
    ref_gap = max_diff(weights(ref), weights(runs[0]))
    print(f"{kind}, no faults: final weights vs {layout[0]} max |diff| {ref_gap:.2e}; groups equal: {nofault_equal}")

    # 3. torchft, group 1 killed and restarted: quorums without it after 2 s of silence
    server = lighthouse(min_replicas=1, join_timeout_ms=5_000)
    faulted = [out / "fault_g0", out / "fault_g1"]
    procs = [start(g, faulted[g], server.address()) for g in range(2)]
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
    restart = start(1, rejoined_run, server.address(), restarted=True)
    codes = [procs[0].wait(), restart.wait()]
    server.shutdown()
    first_step = min(losses(rejoined_run), default=-1)
    rejoined = codes[1] == 0 and first_step > killed_at
    params_equal = codes == [0, 0] and max_diff(weights(faulted[0]), weights(rejoined_run)) == 0.0
    print(
        f"{kind}, fault: group 1 killed after step {killed_at}; group 0 went on alone for {first_step - killed_at - 1} "
        f"steps, group 1 restarted and rejoined at step {first_step}; exit codes {codes}; final weights equal: {params_equal}"
    )
    for name, run in (("no faults", runs[0]), ("fault", faulted[0])):
        s = summary(run)
        print(
            f"{kind}, {name}: group 0 tokens/s {s['tokens_per_s']:.1f}, final train loss {s['final_train_loss']:.4f}, "
            f"final val loss {s['final_val_loss']:.4f}"
        )
    return {
        f"{kind}_survived": int(survived),
        f"{kind}_rejoined": int(rejoined),
        f"{kind}_params_equal": int(params_equal),
        f"{kind}_nofault_equals_reference": int(ref_gap <= 1e-6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=5, help="DiLoCo's H")
    parser.add_argument("--seed", type=int, default=None, help="of the kill step (default: random)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--devices", type=int, default=1, help="processes per group (FSDP inside it; HSDP dp_shard)")
    parser.add_argument("--kinds", nargs="+", default=["hsdp", "diloco"], choices=["hsdp", "diloco"])
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="plait-ft-"))
    out.mkdir(parents=True, exist_ok=True)
    # early enough that group 0 still trains when the restarted group is up (~10-20 s)
    kill_at = random.Random(args.seed).randrange(args.steps // 10, args.steps // 5)
    print(f"runs in {out}; group 1 is killed after step {kill_at} of {args.steps}", flush=True)
    results: dict[str, int] = {}
    for kind in args.kinds:
        results.update(trial(kind, args, out, kill_at))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
