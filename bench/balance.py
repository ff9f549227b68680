"""Work balance across data-parallel ranks: static layout vs `data.balance=work`, side by side.

Document lengths come from a real corpus, the King James Bible's 1189 chapters (bundled with
plait), in tokens estimated as ``ceil(characters / 4)`` (a BPE of a few thousand words gives
about 4 characters per token on this text), plus ``--long`` very long documents (16k to 32k
tokens): a long tail. The documents, shuffled, are packed into rows of ``--seq-len`` tokens by
plait's packer (``split`` policy: a long document fills whole rows), the rows are drawn into
global batches by plait's `GlobalBatchSampler`, and for every step the script estimates each dp
rank's work with plait's work model (`trainer.data.balance.WorkModel` of a Llama of
``--dim`` x ``--layers``: forward FLOPs, linear per token + attention per causal pair):

- ``static``: rank r takes the r-th contiguous slice of the global batch (``data.balance=none``);
- ``balanced``: the same rows ordered by `trainer.data.balance.plan` (``data.balance=work``).

Per layout it prints max/mean work per rank (mean over steps of each step's max over mean), for
total work and for attention work alone, both arms side by side, and the max/mean per micro-batch
slot (FSDP synchronises every micro-batch). Then the dp x ``--cp`` pool: static + zigzag cp,
balanced dp + zigzag cp, balanced dp + document-aware cp, balanced dp + hybrid placement
(`strategies.context.placement`) with whole rows only (groups of 1 and cp ranks) and with the cp
sub-groups too (each row on the smallest of 1, 2, 4, ... ranks that fits it and whose micro-batch
holds a row at ``--micro-batch``; the same as whole rows at cp = 2). These are estimates.

Measured in the same run (``--measure-steps``, 0 skips it): the four pool arms train a nano Llama
with the real CLI on 4 gloo processes (FSDP 2 x CP 2, 256-token rows of a long-tail corpus), and
the balance telemetry logs per step the max/mean over ranks of the forward/backward seconds before
the gradient sync (`strategies.runtime.compute_timer`), of the whole step and of the estimated work of
each dp rank's rows. On CPU the cp ring's exchanges and FSDP's gathers sit inside the forward, and
dense-mask attention costs every row the same, so these ratios stay near 1; on a busy machine
only their comparison within one run means anything.

Invocation (about 30 s of estimate + ~1 min per measured arm on 2 idle cores)::

    python bench/balance.py
    python bench/balance.py --measure-steps 0 --seq-len 4096 --global-batch 64 --dp 8 --micro-batch 2
    python bench/balance.py --measure-steps 0 --cp 4 --micro-batch 4 --dp 2   (cp sub-groups of 2)

The last line is ``RESULT static_max_over_mean=<x> balanced_max_over_mean=<y> static_attention=<a>
balanced_attention=<b> pool_static=<c> pool_balanced=<d> pool_balanced_doc_cp=<e>`` (the first
layout; total work, then attention pairs alone; then the dp x ``--cp`` pool: static layout with
zigzag cp, balanced dp with zigzag cp, balanced dp with document-aware cp), ``pool_hybrid_whole=<w>``
(hybrid, groups of 1 and cp), ``pool_hybrid=<h>`` (hybrid on every cp sub-group size) and,
when measured, ``measured_<arm>=<r>`` (forward/backward before the sync, max/mean per rank).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from strategies.context.document_shards import document_zigzag_order, rank_causal_work
from strategies.context.placement import Placement, fit_sizes, group_sizes, plan_placement, row_counts
from strategies.context.sharding import shard_positions
from strategies.core.shape import ModelShape
from trainer.data import default_corpus
from trainer.data.balance import WorkModel, cells, plan, step_cost
from trainer.data.packing import pack
from trainer.data.sampler import GlobalBatchSampler
from trainer.models.llama import Llama


def lengths(num_long: int, seed: int) -> list[int]:
    """Token lengths of the Bible's chapters plus ``num_long`` documents of 16k to 32k tokens, shuffled."""
    chapters = [-(-len(d.text) // 4) for d in default_corpus.load_bundled(["kjv"])]
    rng = random.Random(seed)
    out = chapters + [rng.randint(16384, 32768) for _ in range(num_long)]
    rng.shuffle(out)
    return out


def shape(dim: int, layers: int, vocab: int, seq_len: int) -> ModelShape:
    with torch.device("meta"):
        model = Llama(
            vocab_size=vocab,
            dim=dim,
            n_layers=layers,
            n_heads=dim // 128,
            n_kv_heads=max(1, dim // 512),
            max_seq_len=seq_len,
        )
    return ModelShape.from_model(model)


def ratio(loads: torch.Tensor) -> float:
    """max / mean of the last dimension, averaged over the others."""
    return float((loads.amax(-1) / loads.mean(-1)).mean())


def measure(document_ids: torch.Tensor, model: WorkModel, args: argparse.Namespace) -> dict[str, float]:
    sampler = GlobalBatchSampler(len(document_ids), global_batch_size=args.global_batch, seed=args.seed)
    attention = WorkModel(linear_per_token=0.0, attention_per_pair=1.0)
    out: dict[str, list[float]] = {}
    for _, rows in zip(range(args.steps), sampler.global_from(0)):
        work = model.rows(document_ids[rows])
        arms = {
            "static": torch.arange(len(rows)),
            "balanced": plan(work, dp_size=args.dp, micro_batch_size=args.micro_batch),
        }
        for arm, order in arms.items():
            ordered = document_ids[rows][order]
            total = cells(model.rows(ordered), dp_size=args.dp, micro_batch_size=args.micro_batch)  # [dp, micro]
            attn = attention.rows(ordered).reshape(args.dp, -1).sum(-1)
            out.setdefault(f"{arm}_total", []).append(ratio(total.sum(-1)))
            out.setdefault(f"{arm}_attention", []).append(ratio(attn))
            out.setdefault(f"{arm}_micro", []).append(step_cost(total) / float(total.sum(1).mean()))
    return {k: sum(v) / len(v) for k, v in out.items()}


def cp_loads(docs_nt: torch.Tensor, model: WorkModel, *, dp: int, cp: int, documents: bool) -> torch.Tensor:
    """``[dp * cp]`` work of every rank of a dp x cp pool: dp rank d trains the d-th slice of the
    rows, each row split over its cp ranks (zigzag chunks, or every document zigzagged)."""
    n, seq_len = docs_nt.shape
    loads = torch.zeros(dp, cp, dtype=torch.float64)
    for i, row in enumerate(docs_nt):
        order = document_zigzag_order(row, cp) if documents else torch.arange(seq_len)
        for c in range(cp):
            pairs = rank_causal_work(row, order[shard_positions(seq_len, cp, c)])
            loads[i // (n // dp), c] += model.linear_per_token * seq_len / cp + model.attention_per_pair * pairs
    return loads.flatten()


def hybrid_loads(
    docs_nt: torch.Tensor, model: WorkModel, *, dp: int, cp: int, sizes: tuple[int, ...]
) -> tuple[torch.Tensor, dict[int, int]]:
    """``[dp * cp]`` work of every rank, and the rows of a dp group per group size, under hybrid placement (`strategies.context.placement`) on cp
    groups of ``sizes`` ranks: the counts per size from the least prefix counts of the dp groups
    (`row_counts`, as the all-reduce gives them), each size's rows on its aligned sub-groups with
    document-aware sharding over the sub-group (whole at size 1), the rest split over all cp ranks."""
    groups = docs_nt.reshape(dp, -1, docs_nt.shape[1])
    prefix = [min(int((fit_sizes(g, cp, sizes) <= size).sum()) for g in groups) for size in sizes]
    counts = row_counts(prefix, cp, sizes)
    loads = []
    for g in groups:
        placed = plan_placement(g, cp, counts) if any(counts.values()) else Placement({}, torch.arange(g.shape[0]))
        rank = torch.zeros(cp, dtype=torch.float64)
        if placed.split.numel():
            rank += cp_loads(g[placed.split], model, dp=1, cp=cp, documents=True)
        for size, blocks in placed.groups.items():
            for b, rows in enumerate(blocks):
                if size == 1:
                    rank[b] += float(model.rows(g[rows]).sum())
                else:
                    rank[b * size : (b + 1) * size] += cp_loads(g[rows], model, dp=1, cp=size, documents=True)
        loads.append(rank)
    return torch.cat(loads), {**counts, cp: groups.shape[1] - sum(counts.values())}


def measure_cp(document_ids: torch.Tensor, model: WorkModel, args: argparse.Namespace) -> dict[str, float]:
    """max/mean over the dp x cp ranks: static + zigzag cp, balanced dp + zigzag cp, balanced dp + document cp,
    balanced dp + hybrid placement."""
    sampler = GlobalBatchSampler(len(document_ids), global_batch_size=args.global_batch, seed=args.seed)
    out: dict[str, list[float]] = {}
    for _, rows in zip(range(args.steps), sampler.global_from(0)):
        docs = document_ids[rows]
        balanced = docs[plan(model.rows(docs), dp_size=args.dp, micro_batch_size=args.micro_batch)]
        for arm, batch, documents in (
            ("static", docs, False),
            ("balanced", balanced, False),
            ("balanced_doc_cp", balanced, True),
        ):
            out.setdefault(arm, []).append(ratio(cp_loads(batch, model, dp=args.dp, cp=args.cp, documents=documents)))
        sizes = group_sizes(args.cp, args.micro_batch)  # the groups whose micro-batches hold a row
        for arm, arm_sizes in (
            ("balanced_hybrid_whole", tuple(g for g in sizes if g == 1)),
            ("balanced_hybrid", sizes),
        ):
            loads, rows_per_size = hybrid_loads(balanced, model, dp=args.dp, cp=args.cp, sizes=arm_sizes)
            out.setdefault(arm, []).append(ratio(loads))
        for size, n in rows_per_size.items():  # of the last arm: the rows of a dp group per group size
            out.setdefault(f"rows_g{size}", []).append(n)
    return {k: sum(v) / len(v) for k, v in out.items()}


# Measured arms on 4 gloo processes (FSDP 2 x CP 2, the real CLI): the estimate's pool arms.
MEASURED_ARMS = {
    "static": ["data.balance=none"],
    "balanced": ["data.balance=work"],
    "balanced_doc_cp": ["data.balance=work", "strategy.context_parallel.sharding=document"],
    "balanced_hybrid": ["data.balance=work", "strategy.context_parallel.sharding=document", "strategy.context_parallel.placement=hybrid"],
}  # fmt: skip
MEASURED_COMMON = [
    "pretrain", "strategy=nd", "strategy.dp_shard=2", "strategy.cp=2", "trainer.devices=4", "model=nano",
    "data.seq_len=256", "model.max_seq_len=256", "train.global_batch_size=16", "train.micro_batch_size=2",
    "train.eval_every=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "logger=csv",
    "~callbacks.plots", "callbacks.balance.enabled=true", "strategy.timeout_s=300",
]  # fmt: skip


def long_tail_corpus(path: Path, seed: int) -> None:
    """400 documents: 3 to 12 words, or (one in seven) 100 to 400 words (whole 256-token rows)."""
    words = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()
    rng = random.Random(seed)
    sizes = [rng.randint(100, 400) if rng.random() < 0.15 else rng.randint(3, 12) for _ in range(400)]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=k))}) + "\n" for k in sizes))


def measure_ranks(steps: int, seed: int) -> dict[str, dict[str, float]]:
    """Per arm, the mean over steps 2.. of the logged max/mean per rank: forward/backward seconds
    before the gradient sync (``perf/balance_compute_max_over_mean``), whole-step seconds and
    estimated work of each dp rank's rows, plus the mean compute seconds of a rank."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="plait-balance-") as tmp:
        corpus_path = Path(tmp) / "long_tail.jsonl"
        long_tail_corpus(corpus_path, seed)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for arm, overrides in MEASURED_ARMS.items():
            run_dir = Path(tmp) / arm
            args = [
                *MEASURED_COMMON,
                f"data.path={corpus_path}",
                f"trainer.max_steps={steps}",
                *overrides,
                f"run_dir={run_dir}",
            ]
            result = subprocess.run(
                [sys.executable, "-m", "trainer.cli", *args], capture_output=True, text=True, env=env, timeout=1800
            )
            if result.returncode != 0:
                raise RuntimeError(f"{arm}: exit {result.returncode}\n{result.stderr[-3000:]}")
            (metrics,) = run_dir.rglob("metrics.csv")
            with metrics.open() as f:
                rows = [
                    r for r in csv.DictReader(f) if r.get("perf/balance_compute_max_over_mean") and int(r["step"]) > 1
                ]
            keys = {
                "compute": "perf/balance_compute_max_over_mean",
                "step": "perf/balance_time_max_over_mean",
                "work": "perf/balance_work_max_over_mean",
                "compute_s": "perf/compute_s_mean",
            }
            if arm == "balanced_hybrid":
                keys["whole_rows"] = "perf/cp_whole_rows"  # per cp group and step, of 8
            out[arm] = {k: sum(float(r[key]) for r in rows) / len(rows) for k, key in keys.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2, help="cp degree of the dp x cp pool table")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--long", type=int, default=8, help="very long documents added to the chapters")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-steps", type=int, default=6, help="steps of each measured 4-process run (0: skip)")
    args = parser.parse_args()
    docs = lengths(args.long, args.seed)
    rows = pack([([0] * n, [0] * n) for n in docs], seq_len=args.seq_len, pad_id=0)
    model = WorkModel.of(shape(args.dim, args.layers, 32000, args.seq_len))
    print(
        f"{len(docs)} documents ({sum(docs)} tokens, {args.long} of 16k-32k) in {len(rows)} rows of {args.seq_len}; "
        f"global batch {args.global_batch}, dp {args.dp}, micro-batch {args.micro_batch}; Llama {args.dim} x {args.layers}"
    )
    print(f"{'max/mean per rank':32s} {'static':>10s} {'balanced':>10s}")
    results = {}
    for layout in [(args.dp, args.micro_batch), (2 * args.dp, args.micro_batch // 2 or 1), (args.dp, 1)]:
        dp, micro = layout
        if args.global_batch % (dp * micro):
            continue
        r = measure(rows.document_ids, model, argparse.Namespace(**{**vars(args), "dp": dp, "micro_batch": micro}))
        results.setdefault("first", r)
        for kind, label in (
            ("total", "work (FLOPs)"),
            ("attention", "attention pairs"),
            ("micro", "synced per micro-batch"),
        ):
            print(f"dp={dp} micro={micro} {label:20s} {r[f'static_{kind}']:10.3f} {r[f'balanced_{kind}']:10.3f}")
    pool = measure_cp(rows.document_ids, model, args)
    print(
        f"dp={args.dp} x cp={args.cp} pool, work per rank: static + zigzag cp {pool['static']:.3f}, balanced dp + "
        f"zigzag cp {pool['balanced']:.3f}, balanced dp + document cp {pool['balanced_doc_cp']:.3f}"
    )
    print(
        f"dp={args.dp} x cp={args.cp} pool, balanced dp + hybrid placement: whole rows and cp {pool['balanced_hybrid_whole']:.3f}, "
        f"on cp groups of {', '.join(map(str, (*group_sizes(args.cp, args.micro_batch), args.cp)))} ranks {pool['balanced_hybrid']:.3f} "
        f"(rows of a dp group per group size, mean: {', '.join(f'{k[6:]}: {v:.2f}' for k, v in pool.items() if k.startswith('rows_g'))})"
    )
    first = results["first"]
    measured = ""
    if args.measure_steps:
        ranks = measure_ranks(args.measure_steps, args.seed)
        print(
            "measured, FSDP 2 x CP 2 on 4 gloo processes (nano Llama, 256-token rows), max/mean per rank, mean of steps 2..:"
        )
        print(
            f"{'arm':18s} {'fwd/bwd before sync':>20s} {'whole step':>11s} {'est. work of dp rows':>21s} {'compute s':>10s}"
        )
        for arm, r in ranks.items():
            whole = f"  (whole rows per cp group and step: {r['whole_rows']:.1f} of 8)" if "whole_rows" in r else ""
            print(f"{arm:18s} {r['compute']:20.3f} {r['step']:11.3f} {r['work']:21.3f} {r['compute_s']:10.3f}{whole}")
        measured = " " + " ".join(f"measured_{arm}={r['compute']:.3f}" for arm, r in ranks.items())
    print(
        f"RESULT static_max_over_mean={first['static_total']:.3f} balanced_max_over_mean={first['balanced_total']:.3f} "
        f"static_attention={first['static_attention']:.3f} balanced_attention={first['balanced_attention']:.3f} "
        f"pool_static={pool['static']:.3f} pool_balanced={pool['balanced']:.3f} pool_balanced_doc_cp={pool['balanced_doc_cp']:.3f} "
        f"pool_hybrid_whole={pool['balanced_hybrid_whole']:.3f} pool_hybrid={pool['balanced_hybrid']:.3f}{measured}"
    )


if __name__ == "__main__":
    main()
