"""Causal work per cp rank on packed rows: zigzag, contiguous and document-aware sharding.

Rows of ``--seq-len`` tokens packed from random documents of 32 to 4096 tokens (uniform lengths,
the last one cut at the row's end, as in bench/cp_maxlen.py but with a longer tail). For each
sharding the exact count of query-key pairs each cp rank's queries attend under the
block-diagonal causal mask (`strategies.context.document_shards.rank_causal_work`), max over mean per row,
the worst row of ``--rows``:

- ``zigzag``: chunks r and 2cp-1-r of the row (`strategies.context.sharding.shard_positions`);
- ``contiguous``: the r-th T/cp tokens;
- ``document``: every document zigzagged on its own (`strategies.context.document_shards`,
  ``strategy.context_parallel.sharding=document``).

Invocation (a few seconds; no model runs)::

    python bench/cp_shards.py
    python bench/cp_shards.py --seq-len 65536 --rows 8

The last line is ``RESULT zigzag_cp2=<x> zigzag_cp4=<y> document_cp2=<a> document_cp4=<b>``.
"""

from __future__ import annotations

import argparse
import random

import torch

from strategies.context.document_shards import document_zigzag_order, rank_causal_work
from strategies.context.sharding import shard_positions


def packed_row(seq_len: int, rng: random.Random) -> torch.Tensor:
    """``[seq_len]`` document ids of a row of random documents of 32 to 4096 tokens."""
    ids, doc = [], 0
    while len(ids) < seq_len:
        ids += [doc] * rng.randint(32, 4096)
        doc += 1
    return torch.tensor(ids[:seq_len])


def imbalance(docs: torch.Tensor, cp: int, sharding: str) -> float:
    seq_len = docs.shape[0]
    order = document_zigzag_order(docs, cp) if sharding == "document" else torch.arange(seq_len)
    work = [
        rank_causal_work(docs, order[shard_positions(seq_len, cp, r, load_balance=sharding != "contiguous")])
        for r in range(cp)
    ]
    return max(work) / (sum(work) / cp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [packed_row(args.seq_len, rng) for _ in range(args.rows)]
    print(f"{args.rows} rows of {args.seq_len} tokens; worst row's max/mean causal work per cp rank")
    print(f"{'':6s} {'zigzag':>10s} {'contiguous':>10s} {'document':>10s}")
    result = {}
    for cp in (2, 4, 8):
        worst = {s: max(imbalance(r, cp, s) for r in rows) for s in ("zigzag", "contiguous", "document")}
        print(f"cp={cp:<3d} {worst['zigzag']:10.4f} {worst['contiguous']:10.4f} {worst['document']:10.4f}")
        result |= {f"zigzag_cp{cp}": worst["zigzag"], f"document_cp{cp}": worst["document"]}
    keys = ("zigzag_cp2", "zigzag_cp4", "document_cp2", "document_cp4")
    print("RESULT " + " ".join(f"{k}={result[k]:.4f}" for k in keys))


if __name__ == "__main__":
    main()
