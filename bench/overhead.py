"""Overhead of plait over a hand-written PyTorch loop: the ratio of their training tokens/s.

Both sides train the same model (same class, same init seed) on the same packed rows in the same
order, for the same steps, in this one process, interleaved: plait, loop, plait, loop, ... The
headline is the median over ``--repeats`` of plait tokens/s / loop tokens/s (1.0 = no overhead).

What is timed, on both sides: the wall-clock from the end of warm-up step ``--warmup`` to the end
of the last step. That window holds, per step, fetching and collating the batch from the loader,
forward, backward, gradient-norm clipping, the AdamW step, the LR-scheduler step, and everything
else the side does between steps (for plait: Lightning's loop and hooks, callbacks, logging and the
progress bar). It excludes data preparation (tokenize and pack; cached), model and optimizer
construction, plait's evaluation at step 0 and at the last step, and the end-of-run writes
(``train.eval_every=0``; the checkpoint and loss-plot callbacks, which only act at the end of a
run this short, are left out to keep the bench quick).

Before timing counts, the script checks that both sides computed the same losses (they should be
bitwise equal), so the two are doing the same work.

Invocations::

    OMP_NUM_THREADS=2 python bench/overhead.py                       # CPU, tiny model, ~5 minutes on 2 cores
    python bench/overhead.py --model nano --seq-len 64 --steps 60   # overhead-dominated small steps
    python bench/overhead.py --steps 200 --warmup 10                # on one GPU (picked automatically)

The last line is ``RESULT overhead_ratio=<x> ...``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Lightning sets torch's thread count when OMP_NUM_THREADS is unset; pin it so both sides match.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from strategies.launch import LAUNCH_ENV  # noqa: E402
from trainer.build import build_data, build_model, build_run  # noqa: E402
from trainer.cli import compose  # noqa: E402
from trainer.config import validate  # noqa: E402
from trainer.data.sampler import GlobalBatchSampler  # noqa: E402
from trainer.optim import lr_factor  # noqa: E402

IGNORE_INDEX = -100
LOSS_TOLERANCE = 1e-5


@dataclass
class Side:
    """One timed run: per-step end times and losses."""

    step_ends: list[float]  # perf_counter at the end of each step, steps 1..N
    losses: list[float]
    tokens_per_step: int
    warmup: int

    @property
    def tokens_per_s(self) -> float:
        seconds = self.step_ends[-1] - self.step_ends[self.warmup - 1]
        return self.tokens_per_step * (len(self.step_ends) - self.warmup) / seconds

    @property
    def median_step_s(self) -> float:
        ends = self.step_ends[self.warmup - 1 :]
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(L.Callback):
    """Records the wall-clock at the end of every training step (added to plait's callbacks by config).

    Callbacks run before the Task's own ``on_train_batch_end`` (where evaluation happens), so the
    last step's end time excludes the final evaluation.
    """

    def __init__(self) -> None:
        self.step_ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        _sync(pl_module.device)
        self.step_ends.append(time.perf_counter())


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model={args.model}",
        f"model.max_seq_len={args.seq_len}",
        f"data.seq_len={args.seq_len}",
        "data.eval_rows=8",  # evaluation is not timed; keep it short
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        "train.eval_every=0",
        f"trainer.max_steps={args.steps}",
        "trainer.devices=1",
        "~callbacks.checkpoint",
        "~callbacks.plots",
    ]


def run_plait(args: argparse.Namespace) -> Side:
    """Fits the pretrain recipe in this process (devices=1: no child process, no FSDP)."""
    cfg = compose("pretrain", [*overrides(args), "+callbacks.clock._target_=__main__.StepClock"])
    validate(cfg)
    with tempfile.TemporaryDirectory(prefix="plait-overhead-") as run_dir:
        trainer, task, data = build_run(cfg, Path(run_dir))
        try:
            trainer.fit(task, datamodule=data)
        finally:
            for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
                os.environ.pop(key, None)
    clock = next(c for c in trainer.callbacks if isinstance(c, StepClock))
    losses = [h["loss"] for h in task.history if "loss" in h]
    return Side(clock.step_ends, losses, args.batch * args.seq_len, args.warmup)


def run_loop(args: argparse.Namespace, device: torch.device) -> Side:
    """The same training, written by hand: no Lightning, no callbacks, no logging."""
    cfg = compose("pretrain", overrides(args))
    prepared = build_data(cfg).prepare()  # the cached rows plait trains on
    model = build_model(cfg, vocab_size=prepared.tokenizer.vocab_size).to(device)  # seeded init
    model.train()

    # AdamW; matmul weights decay, embeddings/norms/biases do not (plait's param groups).
    no_decay = tuple(cfg.train.no_decay)
    decay, rest = [], []
    for name, param in model.named_parameters():
        is_matmul = param.ndim >= 2 and not any(pattern in name for pattern in no_decay)
        (decay if is_matmul else rest).append(param)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps
    )
    sched = cfg.scheduler
    scheduler = LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=sched.warmup_steps, total_steps=args.steps, decay=sched.decay, min_lr_ratio=sched.min_lr_ratio
        ),
    )

    sampler = GlobalBatchSampler(
        len(prepared.train),
        global_batch_size=args.batch,
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
        drop_last=cfg.data.drop_last,
    )
    loader = DataLoader(prepared.train, batch_sampler=sampler)

    losses, step_ends = [], []
    for step, batch in enumerate(loader, start=1):
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["labels"]
        num_tokens = (labels != IGNORE_INDEX).sum().float().clamp(min=1.0)
        logits = model(batch["input_ids"], position_ids_bt=batch["position_ids"], document_ids_bt=batch["document_ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / num_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.detach())
        _sync(device)
        step_ends.append(time.perf_counter())
        if step == args.steps:
            break
    return Side(step_ends, [x.item() for x in losses], args.batch * args.seq_len, args.warmup)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timing")
    parser.add_argument("--model", default="tiny", help="conf/model preset")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (global = micro batch)")
    parser.add_argument("--repeats", type=int, default=3, help="plait/loop pairs, interleaved")
    parser.add_argument("--check-steps", type=int, default=5, help="first steps whose losses must match")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # what accelerator=auto picks
    ratios, plait_tps, loop_tps, plait_step, loop_step, max_diff = [], [], [], [], [], 0.0
    for repeat in range(1, args.repeats + 1):
        gc.collect()
        plait = run_plait(args)
        gc.collect()
        loop = run_loop(args, device)
        diffs = [abs(a - b) for a, b in zip(plait.losses, loop.losses)]
        if len(plait.losses) != args.steps or len(loop.losses) != args.steps:
            sys.exit(f"overhead: expected {args.steps} losses per side, got {len(plait.losses)} and {len(loop.losses)}")
        checked = max(diffs[: args.check_steps])
        if checked > LOSS_TOLERANCE:
            sys.exit(f"overhead: losses differ by {checked:.3g} in the first {args.check_steps} steps; not the same work")
        max_diff = max(max_diff, max(diffs))
        ratios.append(plait.tokens_per_s / loop.tokens_per_s)
        plait_tps.append(plait.tokens_per_s)
        loop_tps.append(loop.tokens_per_s)
        plait_step.append(plait.median_step_s)
        loop_step.append(loop.median_step_s)
        print(
            f"overhead: repeat {repeat}/{args.repeats}: plait {plait.tokens_per_s:.1f} tok/s "
            f"(median step {plait.median_step_s * 1e3:.1f} ms), loop {loop.tokens_per_s:.1f} tok/s "
            f"(median step {loop.median_step_s * 1e3:.1f} ms), ratio {ratios[-1]:.4f}, "
            f"max |loss diff| {max(diffs):.3g}",
            flush=True,
        )
    median_step_ratio = statistics.median(loop_s / plait_s for plait_s, loop_s in zip(plait_step, loop_step))
    print(
        f"overhead: {args.model} seq_len={args.seq_len} batch={args.batch} steps={args.steps} "
        f"(timed {args.steps - args.warmup}) device={device.type} threads={torch.get_num_threads()} "
        f"ratios={','.join(f'{r:.4f}' for r in ratios)}"
    )
    print(
        f"RESULT overhead_ratio={statistics.median(ratios):.4f} "
        f"plait_tokens_per_s={statistics.median(plait_tps):.1f} loop_tokens_per_s={statistics.median(loop_tps):.1f} "
        f"median_step_ratio={median_step_ratio:.4f} max_loss_diff={max_diff:.3g} repeats={args.repeats}"
    )


if __name__ == "__main__":
    main()
