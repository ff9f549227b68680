"""Context parallelism: the longest sequence that trains one step under a fixed activation budget.

For cp = 1, 2, 4 the script runs plait's Llama in cp forked gloo ranks (cp = 1: one process and
plait's default SDPA attention, no context parallelism) through plait's own pieces: the zigzag
`shard_batch`, `apply_context_parallel` (ring, Ulysses or hybrid attention) and the causal-LM
objective with the chunked LM-head cross-entropy. On every rank it counts the bytes of the tensors
autograd saves for the backward of one training step (``torch.autograd.graph.saved_tensors_hooks``;
each storage counted once; parameters and buffers such as the RoPE tables are not activations and
are not counted). A length fits when
the largest per-rank count is within the budget, and it trains (the backward runs). The budget is
the count of cp = 1 at ``--base-len`` tokens; the longest fitting length at each cp is searched on
multiples of 64 tokens. The figure is ``maxlen(cp) / maxlen(1)`` (ideal: cp).

Causal work balance: the query-key pairs each cp rank's queries attend (`causal_work`, exact
counts) on a causal row of ``cp * base_len`` tokens, max over mean, with zigzag shards and with
contiguous ones; also on packed rows of random documents (32 to 1024 tokens).

Invocations::

    OMP_NUM_THREADS=1 python bench/cp_maxlen.py          # 21 min on 2 busy shared CPU cores
    python bench/cp_maxlen.py --base-len 2048 --modes ring,ulysses,hybrid

The last line is ``RESULT maxlen_ratio_cp2=<x> maxlen_ratio_cp4=<y> balanced_work_max_over_mean=<z>``
(ring attention; z at cp = 4 on a causal row).
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist

from strategies.context.attention import apply_context_parallel
from strategies.context.layout import build_cp_layout
from strategies.context.plugin import ulysses_degree_for
from strategies.context.sharding import causal_work, shard_batch
from strategies.runtime.gloo import run_gloo_ranks
from trainer.models.llama import Llama
from trainer.objectives.pretrain import CausalLM

MODEL = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 1 << 16}
STEP = 64


def saved_bytes(model: torch.nn.Module, objective: CausalLM, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd saves for the backward of one forward (unique storages, parameters excluded);
    runs the backward too, so the length is known to train."""
    state = [*model.parameters(), *model.buffers()]  # weights and RoPE tables are not activations
    params = {t.untyped_storage().data_ptr() for t in state}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = objective.loss_sum(model, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _rank_search(rank: int, cp: int, mode: str, budget: int | None, base_len: int) -> dict:
    torch.manual_seed(0)
    model = Llama(**MODEL)
    if cp > 1:
        layout = build_cp_layout([list(range(cp))], ulysses_degree=ulysses_degree_for(mode, cp, 2))
        apply_context_parallel(model, layout=layout, kv_chunk=1024)  # bounds the [Q, keys] score temporaries
    objective = CausalLM(loss_chunk_tokens=1024)

    def worst_rank_bytes(seq_len: int) -> int:
        g = torch.Generator().manual_seed(seq_len)
        ids = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=g)
        # One causal row with positions (as the data pipeline gives), no document ids.
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len)[None]}
        if cp > 1:
            batch = shard_batch(batch, cp=cp, rank=rank)
        count = torch.tensor([saved_bytes(model, objective, batch)], dtype=torch.float64)
        if cp > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    if budget is None:  # cp = 1 at base_len defines the budget
        return {"budget": worst_rank_bytes(base_len)}
    lo, hi = STEP, None  # lo fits; search upwards from the ideal cp * base_len
    probe = cp * base_len
    while hi is None:
        if worst_rank_bytes(probe) <= budget:
            lo, probe = probe, probe * 2
        else:
            hi = probe
    while hi - lo > STEP:  # multiples of 64 tokens: divisible by 2 * cp for cp <= 32
        mid = max((lo + hi) // 2 // STEP * STEP, lo + STEP)
        if worst_rank_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return {"maxlen": lo}


def max_len(cp: int, mode: str, budget: int, base_len: int) -> int:
    fn = lambda rank: _rank_search(rank, cp, mode, budget, base_len)  # noqa: E731
    return (run_gloo_ranks(cp, fn, timeout_s=1200) if cp > 1 else [fn(0)])[0]["maxlen"]


def work_imbalance(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> tuple[float, float]:
    docs = torch.zeros(seq_len, dtype=torch.long) if documents is None else documents
    out = []
    for balanced in (True, False):
        work = causal_work(docs, cp, load_balance=balanced)
        out.append(max(work) / (sum(work) / cp))
    return out[0], out[1]


def random_documents(seq_len: int, seed: int = 0) -> torch.Tensor:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < seq_len:
        lengths.append(rng.randint(32, 1024))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq_len]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-len", type=int, default=1024, help="cp=1 length that defines the budget")
    parser.add_argument("--modes", default="ring,ulysses,hybrid", help="comma-separated cp modes to measure")
    args = parser.parse_args()
    if args.base_len % STEP:
        parser.error(f"--base-len must be a multiple of {STEP}")

    budget = _rank_search(0, 1, "ring", None, args.base_len)["budget"]
    base = max_len(1, "ring", budget, args.base_len)
    print(f"budget: {budget / 2**20:.2f} MiB saved for backward per rank (cp=1 at {args.base_len} tokens)")
    print(f"cp=1 (one process, SDPA): maxlen={base}")
    ratios = {}
    for mode in args.modes.split(","):
        for cp in (2, 4):
            if mode == "hybrid" and cp == 2:
                continue  # hybrid needs 1 < ulysses degree < cp
            length = max_len(cp, mode, budget, args.base_len)
            ratios[(mode, cp)] = length / base
            print(f"cp={cp} {mode:8s}: maxlen={length} ratio={length / base:.3f} (ideal {cp})")
    seq_len = 4 * args.base_len
    for cp in (2, 4):
        balanced, contiguous = work_imbalance(seq_len, cp)
        packed_b, packed_c = work_imbalance(seq_len, cp, random_documents(seq_len))
        print(
            f"causal work max/mean at cp={cp}, T={seq_len}: zigzag {balanced:.4f}, contiguous {contiguous:.4f}; "
            f"packed rows: zigzag {packed_b:.4f}, contiguous {packed_c:.4f}"
        )
    z = work_imbalance(seq_len, 4)[0]
    ring2, ring4 = ratios.get(("ring", 2), float("nan")), ratios.get(("ring", 4), float("nan"))
    print(f"RESULT maxlen_ratio_cp2={ring2:.3f} maxlen_ratio_cp4={ring4:.3f} balanced_work_max_over_mean={z:.4f}")


if __name__ == "__main__":
    main()
