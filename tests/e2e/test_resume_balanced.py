"""Kill-and-resume stays bit-exact with `data.balance=work` (the planner orders each step's rows).

The order of a step's rows is a function of the global batch alone, so a run SIGKILLed after its
step-N checkpoint and resumed with ``resume=last`` trains steps N+1..2N exactly like a straight
run: the losses and gradient norms in metrics.csv are bitwise equal. Micro-batch 1 of a global
batch of 8 rows on DDP 2: the planner orders four one-row micro-batches per rank. Four, not two:
a sum of two terms commutes, so with two micro-batches (or swapped ranks) a resumed run that
ordered them otherwise would still match bitwise, while the order of four accumulations shows in
the bits. Mutation caught: micro-batches reversed on every other `plan` call (a process-local
parity that a resume does not restore): grad_norm of step 4 differs in the last bits. The corpus
is a long tail (most documents a few words, one in four fills whole rows), so the planner
reorders most steps (checked).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import CLI_TINY, compose_config, plait, train_rows

from strategies.checkpoint.dcp import is_checkpoint
from trainer.build import build_data
from trainer.config import validate

N = 3
RUN = [o for o in CLI_TINY if not o.startswith(("trainer.max_steps=", "train.micro_batch_size="))] + [
    f"trainer.max_steps={2 * N}",
    f"callbacks.checkpoint.every_n_steps={N}",
    "callbacks.checkpoint.keep_last=0",
    "train.micro_batch_size=1",
    "strategy=ddp",
    "trainer.devices=2",
    "data.balance=work",
]


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _long_tail(path: Path) -> str:
    rng = random.Random(0)
    words = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
    sizes = [rng.randint(40, 120) if rng.random() < 0.25 else rng.randint(3, 12) for _ in range(400)]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=k))}) + "\n" for k in sizes))
    return str(path)


@pytest.mark.slow
def test_balanced_kill_and_resume_is_bit_exact(tmp_path: Path) -> None:
    run = [*RUN, f"data.path={_long_tail(tmp_path / 'long_tail.jsonl')}"]
    cfg = compose_config(run, tiny=False)
    data = build_data(cfg, validate(cfg))
    batches = data.train_batches(0, 1)
    moved = sum(
        not torch.equal(data.balancer.order(b["document_ids"], 2), torch.arange(8))
        for _, (b, _, _) in zip(range(2 * N), batches.batches(batches.start()))
    )
    assert moved >= N  # the planner is at work in this run
    straight = tmp_path / "straight"
    _ok(plait(*run, f"run_dir={straight}"))
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.cli", *run, f"run_dir={killed}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    step_n, deadline = killed / "checkpoints" / f"step_{N:07d}", time.monotonic() + 300
    try:
        while not is_checkpoint(step_n) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, (
        f"the run ended on its own (exit {process.returncode}):\n{stderr[-3000:]}"
    )
    _ok(plait(*run, f"run_dir={killed}", "resume=last"))
    reference, resumed = train_rows(straight), train_rows(killed)
    for row in range(N + 1, 2 * N + 1):
        for key in ("train/loss", "train/grad_norm"):
            assert resumed[row][key] == reference[row][key], (row, key, resumed[row][key], reference[row][key])
