"""Overhead of plait over a hand-written PyTorch loop: the ratio of their training tokens/s.

Both sides train the same model (same class, same init seed) on the same packed rows in the same
order, for the same steps, in this one process. The headline is the median over ``--repeats`` of
plait tokens/s / loop tokens/s (1.0 = no overhead; below 1.0 = plait is slower).

Interleaving (``--interleave``), because the machine may be shared and its speed drifts:

- ``steps`` (default): one plait run that also drives the hand-written loop, one loop step just
  before each plait step, so both sides see the same load within a second. Each side's time is
  its own steps only: the loop step is timed and taken out of plait's time. (plait's progress
  bar counts the loop's steps in its tok/s then; the bench does not use that figure.)
- ``runs``: whole runs in turn, plait, loop, plait, loop, ... Simpler, but a change of load
  between two runs (tens of seconds on a shared machine) shows up as "overhead".

What is timed, on both sides: every step after the first ``--warmup`` steps, end to end. For the
loop, a step is: fetch and collate the batch from the DataLoader, forward, token-sum
cross-entropy / supervised-token count, backward, clip_grad_norm_, AdamW step, zero_grad, LR
scheduler step. For plait, a step is the time from the end of one step to the end of the next:
the same work plus everything plait and Lightning do between and around it (the loop, hooks,
callbacks, logging, the progress bar). Not timed: data preparation (tokenize and pack, cached),
building the model and trainer, plait's evaluation at step 0 and at the last step
(``train.eval_every=0`` still evaluates there), and the end-of-run writes. The checkpoint and
loss-plot callbacks only act at the end of a run this short, so they are left out to keep the
bench quick.

Before any ratio counts, the script checks that both sides computed the same losses (they are
bitwise equal on CPU), so the two are doing the same work. On a GPU both sides synchronize at the
end of every step, so host time that would overlap with the next step's kernels counts in full:
an upper bound on the overhead there.

Invocations::

    OMP_NUM_THREADS=2 python bench/overhead.py                      # CPU, tiny model: ~2.5 minutes on 2 idle cores
    python bench/overhead.py --model nano --seq-len 64 --steps 100 # small steps: overhead shows most
    python bench/overhead.py --steps 200 --warmup 10               # one GPU (accelerator=auto picks it)

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Lightning sets torch's thread count when OMP_NUM_THREADS is unset; pin it so both sides match.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from strategies.runtime.launch import LAUNCH_ENV  # noqa: E402
from trainer.build import build_data, build_model, build_run  # noqa: E402
from trainer.compose import compose  # noqa: E402
from trainer.config import validate  # noqa: E402
from trainer.data.sampler import GlobalBatchSampler  # noqa: E402
from trainer.optim import lr_factor  # noqa: E402

IGNORE_INDEX = -100
LOSS_TOLERANCE = 1e-5


@dataclass
class Side:
    """One side of one repeat: seconds of each step (1..N) and each step's loss."""

    step_s: list[float]
    losses: list[float]
    tokens_per_step: int
    warmup: int

    @property
    def tokens_per_s(self) -> float:
        timed = self.step_s[self.warmup :]
        return self.tokens_per_step * len(timed) / sum(timed)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s[self.warmup :])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overrides(args: argparse.Namespace) -> list[str]:
    """The pretrain recipe at the bench's size, without evaluation and end-of-run files."""
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


class HandLoop:
    """The same training written by hand: no Lightning, no callbacks, no logging."""

    def __init__(self, cfg: DictConfig, *, steps: int, device: torch.device) -> None:
        run = validate(cfg)
        prepared = build_data(cfg, run).prepare()  # the cached rows plait trains on
        self.device = device
        self.model = build_model(cfg, run, vocab_size=prepared.tokenizer.vocab_size).to(device)  # seeded init
        self.model.train()
        self.max_grad_norm = cfg.train.max_grad_norm

        # AdamW; matmul weights decay, embeddings, norms and biases do not (plait's param groups).
        decay, rest = [], []
        for name, param in self.model.named_parameters():
            is_matmul = param.ndim >= 2 and not any(pattern in name for pattern in cfg.train.no_decay)
            (decay if is_matmul else rest).append(param)
        groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            fused=cfg.optim.get("fused"),  # plait's default: one fused kernel (its rounding differs from the loop's)
        )
        sched = cfg.scheduler
        schedule = dict(warmup_steps=sched.warmup_steps, decay=sched.decay, min_lr_ratio=sched.min_lr_ratio)
        self.scheduler = LambdaLR(self.optimizer, lambda step: lr_factor(step, total_steps=steps, **schedule))
        sampler = GlobalBatchSampler(
            len(prepared.train),
            global_batch_size=cfg.train.global_batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            drop_last=cfg.data.drop_last,
        )
        self.batches = iter(DataLoader(prepared.train, batch_sampler=sampler))
        self.losses: list[torch.Tensor] = []

    def step(self) -> None:
        batch = {k: v.to(self.device) for k, v in next(self.batches).items()}
        labels = batch["labels"]
        num_tokens = (labels != IGNORE_INDEX).sum().float().clamp(min=1.0)
        logits = self.model(
            batch["input_ids"], position_ids_bt=batch["position_ids"], document_ids_bt=batch["document_ids"]
        )
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = loss_sum / num_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.losses.append(loss.detach())  # no .item() here: no device sync inside the loop


class StepClock(L.Callback):
    """Times plait's steps end to end; added to plait's callbacks through the config.

    A step runs from the end of the previous one (the first: from its batch start) to its
    ``on_train_batch_end``. Callbacks run before the Task's own ``on_train_batch_end``, where
    evaluation happens, so the final evaluation is not in the last step; the Task's hook of every
    earlier step is in the next step. With ``alongside`` set, one hand-loop step runs at the start
    of each plait step; its time is recorded separately and taken out of plait's step.
    """

    def __init__(self) -> None:
        self.alongside: Callable[[], None] | None = None
        self.step_s: list[float] = []
        self.alongside_s: list[float] = []
        self._since: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._since is None:
            _sync(pl_module.device)
            self._since = time.perf_counter()
        if self.alongside is not None:
            _sync(pl_module.device)
            start = time.perf_counter()
            self.alongside()
            _sync(pl_module.device)
            elapsed = time.perf_counter() - start
            self.alongside_s.append(elapsed)
            self._since += elapsed

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        _sync(pl_module.device)
        now = time.perf_counter()
        self.step_s.append(now - self._since)
        self._since = now


def run_plait(args: argparse.Namespace, *, alongside: HandLoop | None = None) -> tuple[Side, list[float]]:
    """Fits the pretrain recipe in this process (devices=1: no child process, and no FSDP at world 1).

    Returns plait's side and the seconds of each ``alongside`` step (empty without one).
    """
    cfg = compose("pretrain", [*overrides(args), "+callbacks.clock._target_=__main__.StepClock"])
    validate(cfg)
    with tempfile.TemporaryDirectory(prefix="plait-overhead-") as run_dir:
        trainer, task, data = build_run(cfg, Path(run_dir))
        clock = next(c for c in trainer.callbacks if isinstance(c, StepClock))
        clock.alongside = alongside.step if alongside is not None else None
        try:
            trainer.fit(task, datamodule=data)
        finally:
            for key in LAUNCH_ENV:  # the next fit in this process must not look "launched externally"
                os.environ.pop(key, None)
    losses = [h["loss"] for h in task.history if "loss" in h]
    return Side(clock.step_s, losses, args.batch * args.seq_len, args.warmup), clock.alongside_s


def run_loop(args: argparse.Namespace, device: torch.device) -> Side:
    loop = HandLoop(compose("pretrain", overrides(args)), steps=args.steps, device=device)
    step_s = []
    _sync(device)
    since = time.perf_counter()
    for _ in range(args.steps):
        loop.step()
        _sync(device)
        now = time.perf_counter()
        step_s.append(now - since)
        since = now
    return Side(step_s, [x.item() for x in loop.losses], args.batch * args.seq_len, args.warmup)


def run_interleaved(args: argparse.Namespace, device: torch.device) -> tuple[Side, Side]:
    loop = HandLoop(compose("pretrain", overrides(args)), steps=args.steps, device=device)
    plait, loop_step_s = run_plait(args, alongside=loop)
    return plait, Side(loop_step_s, [x.item() for x in loop.losses], plait.tokens_per_step, args.warmup)


def check_same_work(plait: Side, loop: Side, args: argparse.Namespace) -> float:
    """Max |loss difference| over all steps; exits if the first ``--check-steps`` differ."""
    if len(plait.losses) != args.steps or len(loop.losses) != args.steps:
        sys.exit(f"overhead: expected {args.steps} losses per side, got {len(plait.losses)} and {len(loop.losses)}")
    diffs = [abs(a - b) for a, b in zip(plait.losses, loop.losses)]
    first = max(diffs[: args.check_steps])
    if first > LOSS_TOLERANCE:
        sys.exit(f"overhead: losses differ by {first:.3g} in the first {args.check_steps} steps: not the same work")
    return max(diffs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the timing")
    parser.add_argument("--model", default="tiny", help="conf/model preset")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (global = micro batch)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; the median ratio is reported")
    parser.add_argument("--interleave", choices=("steps", "runs"), default="steps", help="see the module docstring")
    parser.add_argument("--check-steps", type=int, default=5, help="first steps whose losses must match")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # what accelerator=auto picks
    rows = []
    for repeat in range(1, args.repeats + 1):
        gc.collect()
        if args.interleave == "steps":
            plait, loop = run_interleaved(args, device)
        else:
            plait, _ = run_plait(args)
            gc.collect()
            loop = run_loop(args, device)
        row = {
            "ratio": plait.tokens_per_s / loop.tokens_per_s,
            "plait": plait.tokens_per_s,
            "loop": loop.tokens_per_s,
            "median_step_ratio": loop.median_step_s / plait.median_step_s,
            "loss_diff": check_same_work(plait, loop, args),
        }
        rows.append(row)
        print(
            f"overhead: repeat {repeat}/{args.repeats}: plait {row['plait']:.1f} tok/s "
            f"(median step {plait.median_step_s * 1e3:.1f} ms), loop {row['loop']:.1f} tok/s "
            f"(median step {loop.median_step_s * 1e3:.1f} ms), ratio {row['ratio']:.4f}, "
            f"median-step ratio {row['median_step_ratio']:.4f}, max |loss diff| {row['loss_diff']:.3g}",
            flush=True,
        )

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"overhead: model={args.model} seq_len={args.seq_len} batch={args.batch} steps={args.steps} "
        f"(timed: {args.steps - args.warmup} after {args.warmup} warm-up) interleave={args.interleave} "
        f"device={device.type} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"lightning={L.__version__} ratios={','.join(format(r['ratio'], '.4f') for r in rows)}"
    )
    print(
        f"RESULT overhead_ratio={median('ratio'):.4f} plait_tokens_per_s={median('plait'):.1f} "
        f"loop_tokens_per_s={median('loop'):.1f} median_step_ratio={median('median_step_ratio'):.4f} "
        f"max_loss_diff={max(r['loss_diff'] for r in rows):.3g} interleave={args.interleave} repeats={args.repeats}"
    )


if __name__ == "__main__":
    main()
