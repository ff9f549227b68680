"""Sparsity-accelerated training (SAT) vs dense training: step time and final loss, side by side.

Three copies of one tiny Llama (the same initial weights) train on the same rows of the bundled
corpus (the ``pretrain`` recipe's data, seq 256) with AdamW, step by step in turn in this one
process: one arm dense, one with `strategies.transforms.sat.SAT` omitting ``--rate`` of every MLP's hidden
channels at every step, one on the preset's ladder schedule (``rate`` x 1 for the first half of
the steps, x 0.5 to 3/4, dense for the last quarter). The order of the arms rotates every step, so
contention on a shared machine hits them alike; only ratios from one run mean anything.
Use one thread on a shared machine: with OMP_NUM_THREADS=2 and more runnable processes than cores,
every parallel region waits for a descheduled thread and the op count, not the FLOPs, sets the time.

Reported: each arm's median step time and its total over the timed steps, and their ratios to
dense; the prediction ``1 - rate x share`` (the ladder: ``1 - mean rate x share``), with the MLP's
share of the dense step measured in the same run (forward + backward of the model's MLPs alone on
the step's activation shape, timed in turn with the steps) and, for reference, the MLP's share of
the model's matmul FLOPs; the kept-channel MLP alone against the dense MLP alone (ideal
``1 - rate``: what the gathers and gradient scatters of the kept path cost); the final held-out
loss of each arm (claim 6 of SAT: a small gap) and the load average at the start and the end.

Invocations::

    OMP_NUM_THREADS=1 python bench/sat.py                # tiny, 300 steps: ~2.7 CPU-s a step, ~14 CPU-min
    OMP_NUM_THREADS=1 python bench/sat.py --steps 150    # the figures in docs/benchmarks.md (7 CPU-min)
    python bench/sat.py --rate 0.3 --steps 100 --model nano

The last line is ``RESULT sat_step_time_ratio=<sat/dense, medians> ladder_time_ratio=<ladder/dense,
totals> predicted_ratio=<1 - r x share> ladder_predicted_ratio=<1 - mean r x share>
mlp_share=<measured> mlp_kept_ratio=<kept MLP / dense MLP> dense_loss=<x> sat_loss=<y>
ladder_loss=<z> loss_gap=<y - x> ladder_loss_gap=<z - x>``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

from strategies.transforms.sat import SAT
from trainer.build import build_data, build_model
from trainer.compose import compose
from trainer.config import validate
from trainer.data.packing import IGNORE_INDEX


def loss_of(model: torch.nn.Module, rows, index) -> torch.Tensor:
    logits = model(
        rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index]
    )
    labels = rows.labels[index]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def timed_step(model, optimizer, rows, index, sat: SAT | None, step: int) -> float:
    start = time.perf_counter()
    if sat is not None:
        with sat.step(step):
            loss_of(model, rows, index).backward()
    else:
        loss_of(model, rows, index).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def mlp_time(model: torch.nn.Module, x_btd: torch.Tensor, sat: SAT | None = None, step: int = 0) -> float:
    """Forward + backward of every block's MLP alone on an input of the step's shape (seconds);
    with ``sat``: its kept channels of step ``step``."""
    x = x_btd.detach().requires_grad_(True)
    start = time.perf_counter()
    with sat.step(step) if sat is not None else contextlib.nullcontext():
        for block in model.layers.values():
            block.feed_forward(x).sum().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


@torch.no_grad()
def val_loss(model: torch.nn.Module, rows, num_rows: int) -> float:
    model.eval()
    losses = [loss_of(model, rows, torch.arange(i, min(i + 8, num_rows))).item() for i in range(0, num_rows, 8)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    load_start = os.getloadavg()

    cfg = compose(
        "pretrain", [f"model={args.model}", f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}"]
    )
    prepared = build_data(cfg).prepare()
    torch.manual_seed(0)
    template = build_model(cfg, validate(cfg), vocab_size=prepared.tokenizer.vocab_size)
    ladder = compose("pretrain", ["+strategy/sat=default", f"trainer.max_steps={args.steps}"]).strategy.sat.ladder
    plugins = {
        "dense": None,
        "sat": SAT(rate=args.rate, seed=0),
        "ladder": SAT(rate=args.rate, seed=0, ladder=list(ladder), total_steps=args.steps),
    }
    # Every arm trains its own copy: the built model itself ran ~8% slower than a copy of it in one
    # side-by-side check (allocation placement), which would have favoured the SAT arms.
    arms = {name: (copy.deepcopy(template), plugin) for name, plugin in plugins.items()}
    for model, plugin in arms.values():
        if plugin is not None:
            plugin.apply(model)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for k, (m, _) in arms.items()}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in (*arms, "mlp", "mlp_kept")}
    dense = arms["dense"][0]
    x_btd = torch.randn(args.batch, args.seq_len, dense.dim)
    probe = copy.deepcopy(template)  # the MLP timings' own copy: the arms' weights and gradients stay untouched
    kept_probe = SAT(rate=args.rate, seed=1)
    kept_probe.apply(probe)
    names = list(arms)
    for step in range(args.steps):
        index = torch.randint(len(prepared.train), (args.batch,), generator=generator)
        for name in names[step % 3 :] + names[: step % 3]:
            model, plugin = arms[name]
            times[name].append(timed_step(model, optimizers[name], prepared.train, index, plugin, step))
        pair = [("mlp", None), ("mlp_kept", kept_probe)]
        for name, plugin in pair if step % 2 == 0 else pair[::-1]:
            times[name].append(mlp_time(probe, x_btd, plugin, step))
    report(args, arms, plugins, times, ladder, load_start, prepared.val)


def report(args, arms, plugins, times, ladder, load_start, val_rows) -> None:
    """Prints the ratios, predictions and held-out losses of the run, and the RESULT line."""
    dense = arms["dense"][0]
    skip = min(10, args.steps // 5)  # warm-up steps (allocator, first calls)
    median = {k: statistics.median(v[skip:]) for k, v in times.items()}
    total = {k: sum(v[skip:]) for k, v in times.items()}
    ratio, ladder_ratio = median["sat"] / median["dense"], total["ladder"] / total["dense"]
    share = median["mlp"] / median["dense"]
    kept_ratio = median["mlp_kept"] / median["mlp"]
    mean_rate = statistics.fmean(plugins["ladder"].rate_at(s) for s in range(skip, args.steps))
    predicted, ladder_predicted = 1 - args.rate * share, 1 - mean_rate * share
    ffn = 3 * dense.dim * dense.ffn_dim * dense.n_layers * 6
    flops_share = ffn / dense.flops_per_token(args.seq_len)
    num_val = min(64, len(val_rows))
    losses = {name: val_loss(model, val_rows, num_val) for name, (model, _) in arms.items()}
    gap, ladder_gap = losses["sat"] - losses["dense"], losses["ladder"] - losses["dense"]
    print(
        f"model={args.model} ({sum(p.numel() for p in dense.parameters())} parameters), {args.steps} AdamW steps of "
        f"{args.batch} x {args.seq_len} tokens, SAT rate {args.rate}, ladder {list(map(list, ladder))} "
        f"(mean rate {mean_rate:.3f}), torch threads {torch.get_num_threads()}"
    )
    print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    for name in arms:
        print(
            f"{name:>6}: median step {median[name] * 1e3:.1f} ms (/dense {median[name] / median['dense']:.3f}), "
            f"total {total[name]:.1f} s (/dense {total[name] / total['dense']:.3f}), held-out loss {losses[name]:.4f}"
        )
    print(
        f"MLP share of the dense step: measured {share:.3f} (MLPs alone {median['mlp'] * 1e3:.1f} ms), of the matmul "
        f"FLOPs {flops_share:.3f}; kept-channel MLPs alone {median['mlp_kept'] * 1e3:.1f} ms = {kept_ratio:.3f} x dense "
        f"(ideal {1 - args.rate:.3f}); predicted ratio sat {predicted:.3f}, ladder {ladder_predicted:.3f}"
    )
    print(f"held-out loss ({num_val} rows) gap to dense: sat {gap:+.4f}, ladder {ladder_gap:+.4f}")
    print(
        f"RESULT sat_step_time_ratio={ratio:.3f} ladder_time_ratio={ladder_ratio:.3f} predicted_ratio={predicted:.3f} "
        f"ladder_predicted_ratio={ladder_predicted:.3f} mlp_share={share:.3f} mlp_kept_ratio={kept_ratio:.3f} "
        f"dense_loss={losses['dense']:.4f} sat_loss={losses['sat']:.4f} ladder_loss={losses['ladder']:.4f} "
        f"loss_gap={gap:.4f} ladder_loss_gap={ladder_gap:.4f}"
    )


if __name__ == "__main__":
    main()
