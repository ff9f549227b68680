"""Sparsity-accelerated training (SAT) vs dense training: step time and final loss, side by side.

Two copies of one tiny Llama (the same initial weights) train on the same rows of the bundled
corpus (the ``pretrain`` recipe's data, seq 256) with AdamW, step by step in turn in this one
process: one arm dense, one with `strategies.sat.SAT` omitting ``--rate`` of every MLP's hidden
channels per step (forward and backward skip their matmul work). The order of the two arms
alternates every step, so contention on a shared machine hits both alike.

Reported: the median step time of each arm and their ratio; the prediction ``1 - rate x share``,
with the MLP's share of the dense step measured in the same run (forward + backward of the model's
MLPs alone on the step's activations, timed in turn with the steps) and, for reference, the MLP's
share of the model's matmul FLOPs; the final held-out loss of each arm (claim 6 of SAT: a small gap).

Invocations::

    OMP_NUM_THREADS=2 python bench/sat.py                  # tiny model, 300 steps: ~5 minutes on 2 idle cores
    python bench/sat.py --rate 0.3 --steps 100 --model nano

The last line is ``RESULT sat_step_time_ratio=<sat/dense> predicted_ratio=<1 - r x share>
mlp_share=<measured> sat_loss=<x> dense_loss=<y> loss_gap=<x - y>``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from strategies.sat import SAT
from trainer.build import build_data, build_model
from trainer.config import validate
from trainer.compose import compose
from trainer.data.packing import IGNORE_INDEX


def loss_of(model: torch.nn.Module, rows, index) -> torch.Tensor:
    logits = model(rows.input_ids[index], position_ids_bt=rows.position_ids[index], document_ids_bt=rows.document_ids[index])
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


def mlp_time(model: torch.nn.Module, x_btd: torch.Tensor) -> float:
    """Forward + backward of every block's MLP alone on an input of the step's shape (seconds)."""
    x = x_btd.detach().requires_grad_(True)
    start = time.perf_counter()
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

    cfg = compose("pretrain", [f"model={args.model}", f"data.seq_len={args.seq_len}", f"model.max_seq_len={args.seq_len}"])
    prepared = build_data(cfg).prepare()
    torch.manual_seed(0)
    dense = build_model(cfg, validate(cfg), vocab_size=prepared.tokenizer.vocab_size)
    sparse = copy.deepcopy(dense)
    sat = SAT(rate=args.rate, seed=0)
    sat.apply(sparse)
    arms = {"dense": (dense, None), "sat": (sparse, sat)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for k, (m, _) in arms.items()}
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"dense": [], "sat": [], "mlp": []}
    x_btd = torch.randn(args.batch, args.seq_len, dense.dim)
    for step in range(args.steps):
        index = torch.randint(len(prepared.train), (args.batch,), generator=generator)
        order = ["dense", "sat"] if step % 2 == 0 else ["sat", "dense"]
        for name in order:
            model, plugin = arms[name]
            times[name].append(timed_step(model, optimizers[name], prepared.train, index, plugin, step))
        times["mlp"].append(mlp_time(dense, x_btd))
    skip = min(10, args.steps // 5)  # warm-up steps (allocator, first calls)
    median = {k: statistics.median(v[skip:]) for k, v in times.items()}
    ratio = median["sat"] / median["dense"]
    share = median["mlp"] / median["dense"]
    ffn = 3 * dense.dim * dense.ffn_dim * dense.n_layers * 6
    flops_share = ffn / dense.flops_per_token(args.seq_len)
    num_val = min(64, len(prepared.val))
    losses = {name: val_loss(model, prepared.val, num_val) for name, (model, _) in arms.items()}
    gap = losses["sat"] - losses["dense"]
    print(f"model={args.model} ({sum(p.numel() for p in dense.parameters())} parameters), {args.steps} AdamW steps of "
          f"{args.batch} x {args.seq_len} tokens, SAT rate {args.rate}, torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"median step: dense {median['dense'] * 1e3:.1f} ms, SAT {median['sat'] * 1e3:.1f} ms, ratio {ratio:.3f}")
    print(f"MLP share of the dense step: measured {share:.3f} (MLPs alone {median['mlp'] * 1e3:.1f} ms), "
          f"of the matmul FLOPs {flops_share:.3f}; predicted ratio 1 - r x share = {1 - args.rate * share:.3f}")  # fmt: skip
    print(f"held-out loss ({num_val} rows): dense {losses['dense']:.4f}, SAT {losses['sat']:.4f}, gap {gap:+.4f}")
    print(
        f"RESULT sat_step_time_ratio={ratio:.3f} predicted_ratio={1 - args.rate * share:.3f} mlp_share={share:.3f} "
        f"sat_loss={losses['sat']:.4f} dense_loss={losses['dense']:.4f} loss_gap={gap:.4f}"
    )


if __name__ == "__main__":
    main()
