"""FSDP training-state bytes vs DDP: does sharding over N ranks divide the per-rank bytes by N?

For each layout the script trains plait's Llama for one real AdamW step in N forked gloo ranks
(so gradients and optimizer state exist) and sums, on each rank, the bytes it holds of parameters,
gradients and optimizer state (exp_avg, exp_avg_sq, step). A DTensor counts its local shard
(``to_local()``), a plain tensor counts in full. Layouts, all through plait's ``apply_fsdp``:

- ``replicated``: the model unwrapped, one process (DDP's per-rank bytes: every rank holds it all).
- ``ddp``: FSDP2 over a (dp_replicate=N, dp_shard=1) mesh, what plait's ddp preset runs.
- ``fsdp``: FSDP2 over a (dp_shard=N) mesh, plait's fsdp preset.

The figure is ``N x max per-rank bytes / replicated bytes``: 1.0 means the shards add up to one
model with no duplication (ZeRO-3); ``N`` would mean every rank keeps a full copy. The one
expected excess is AdamW's ``step``, a 4-byte scalar that every rank keeps per parameter.

Invocations::

    OMP_NUM_THREADS=1 python bench/fsdp_memory.py             # tiny preset shape, vocab 4096; ~20 s on 2 cores
    python bench/fsdp_memory.py --dim 256 --n-layers 8        # another shape

The last line is ``RESULT fsdp_bytes_ratio_n2=<x> fsdp_bytes_ratio_n4=<y>``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from strategies.fsdp import apply_fsdp
from strategies.runtime.gloo import run_gloo_ranks
from trainer.models.llama import Llama


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: its local shard for a DTensor."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state."""
    params = list(model.parameters())
    state: Iterable[torch.Tensor] = (
        v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)
    )
    return {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optim": sum(tensor_bytes(v) for v in state),
    }


def one_step(model_kwargs: dict, layout: str, world_size: int) -> dict[str, int]:
    """Builds the model (same seed on every rank), shards it per ``layout``, runs one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Llama(**model_kwargs)
    if layout == "fsdp":
        apply_fsdp(model, dp_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",)))
    elif layout == "ddp":
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        apply_fsdp(model, dp_mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens_bt = torch.randint(0, model_kwargs["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(1))
    logits_btv = model(tokens_bt[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits_btv.flatten(0, 1), tokens_bt[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    return state_bytes(model, optimizer)


def run_ranks(world_size: int, model_kwargs: dict, layout: str, timeout_s: float = 120.0) -> list[dict[str, int]]:
    """``one_step`` in ``world_size`` forked gloo ranks; the byte counts by rank."""
    return run_gloo_ranks(world_size, lambda rank: one_step(model_kwargs, layout, world_size), timeout_s=timeout_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--n-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    model_kwargs = dict(
        vocab_size=args.vocab_size,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        max_seq_len=256,
    )

    # One process, no process group: the bytes each DDP rank holds.
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:  # forked, so this process stays free of gloo state before the ranks fork
        replicated = pool.apply(one_step, (model_kwargs, "replicated", 1))
    base = sum(replicated.values())
    print(f"model: {model_kwargs}")
    print(
        f"replicated (DDP) per-rank bytes: {base:,} = params {replicated['params']:,} + grads "
        f"{replicated['grads']:,} + optimizer state {replicated['optim']:,}"
    )
    print()
    print(
        "| N | layout | per-rank bytes (max) | params | grads | optimizer state | per-rank / DDP | N x per-rank / DDP |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[int, float] = {}
    for n in args.world_sizes:
        for layout in ("ddp", "fsdp"):
            per_rank = run_ranks(n, model_kwargs, layout)
            worst = max(per_rank, key=lambda r: sum(r.values()))
            ratio = n * sum(worst.values()) / base
            if layout == "fsdp":
                ratios[n] = ratio
            name = "FSDP2 (dp_shard=N)" if layout == "fsdp" else "DDP preset (dp_replicate=N, dp_shard=1)"
            print(
                f"| {n} | {name} | {sum(worst.values()):,} | {worst['params']:,} | {worst['grads']:,} | "
                f"{worst['optim']:,} | {ratio / n:.4f} | {ratio:.4f} |"
            )
    print()
    print("RESULT " + " ".join(f"fsdp_bytes_ratio_n{n}={r:.6f}" for n, r in ratios.items()))


if __name__ == "__main__":
    main()
