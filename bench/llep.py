"""Least-loaded expert parallelism against standard expert parallelism under a skewed router.

On ``--ranks`` forked gloo ranks, one MoE layer's experts (``--experts`` SwiGLU experts of width
``--dim`` x ``--ffn``, top-``--top-k``) are sharded over ep = ranks by plait's
`strategies.expert.plugin.ExpertParallel`, once with the standard all-to-all dispatch and once with LLEP
(``--ratio``, ``--min-tokens``). Every rank routes ``--tokens`` tokens; a fraction ``--skew`` of
the first choices go to expert 0 (the rest uniform), as a trained router's hot expert does.
Per rank and method the script counts the rows the rank's grouped GEMMs compute and the bytes of
the tensors autograd saves inside the experts' computation for backward (the expert
activations, plus LLEP's borrowed weight copies; each storage once;
``torch.autograd.graph.saved_tensors_hooks``), through one forward and backward. Outputs and
gradients of the two methods are compared (they must agree to fp32 rounding).

Invocation::

    OMP_NUM_THREADS=1 python bench/llep.py                      # about 1 minute on 2 CPU cores
    python bench/llep.py --ranks 2 --skew 0.8

The last line is ``RESULT ep_max_over_mean=<a> llep_max_over_mean=<b> ep_peak_act_mb=<c>
llep_peak_act_mb=<d> peak_act_ratio=<c/d> max_abs_diff=<e>`` (max over ranks).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--skew", type=float, default=0.95)
    p.add_argument("--ratio", type=float, default=1.1)
    p.add_argument("--min-tokens", type=int, default=16)
    return p.parse_args()


def _saved_bytes(fn):
    """Runs ``fn`` and returns (its result, bytes of the storages autograd saved inside it)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from strategies.expert.plugin import ExpertParallel, apply_expert_parallel
    from trainer.models.moe import GroupedExperts, combine, sort_by_expert

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,), mesh_dim_names=("ep",))
    E, K, N = args.experts, args.top_k, args.tokens
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, args.dim, generator=g)
    first = torch.where(torch.rand(N, generator=g) < args.skew, 0, torch.randint(0, E, (N,), generator=g))
    chosen = torch.stack([first] + [(first + k) % E for k in range(1, K)], 1)
    weights = torch.full((N, K), 1.0 / K)
    result = {}
    for name, plugin in [
        ("ep", ExpertParallel(ep=args.ranks)),
        (
            "llep",
            ExpertParallel(
                ep=args.ranks, least_loaded=True, capacity_ratio=args.ratio, min_tokens_per_gemm=args.min_tokens
            ),
        ),
    ]:
        torch.manual_seed(0)
        experts = GroupedExperts(args.dim, args.ffn, E)
        for w in (experts.w1, experts.w2, experts.w3):
            torch.nn.init.normal_(w, std=0.02)
        apply_expert_parallel(experts, mesh, plugin.dispatcher(mesh.get_group()))
        compute = experts.compute
        peak = {"bytes": 0}

        def measured(*a, _compute=compute, _peak=peak, **kw):
            out, nbytes = _saved_bytes(lambda: _compute(*a, **kw))
            _peak["bytes"] = max(_peak["bytes"], nbytes)
            return out

        experts.compute = measured
        xs = x.clone().requires_grad_()
        order, counts = sort_by_expert(chosen, E)
        out = combine(experts(xs[order // K], counts), order, weights)
        out.square().sum().backward()
        loads = experts.dispatcher.pop_rank_loads()[0]
        result[name] = {
            "out": out.detach(),
            "grad": xs.grad,
            "loads": loads,
            "act_bytes": peak["bytes"],
            "w1_grad": experts.w1.grad.full_tensor(),
        }
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    os._exit(0)


def main() -> None:
    args = _parse()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_worker, args=(r, args, port, out_dir)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]
    figures = {}
    for name in ("ep", "llep"):
        loads = results[0][name]["loads"].float()
        acts = [r[name]["act_bytes"] for r in results]
        figures[name] = (loads.max().item() / loads.mean().item(), max(acts) / 2**20)
        print(
            f"{name:5s} rows per rank {loads.tolist()}  max/mean {figures[name][0]:.3f}  "
            f"expert activation MiB per rank {[round(a / 2**20, 2) for a in acts]}"
        )
    diff = max(max((r["ep"][k] - r["llep"][k]).abs().max().item() for k in ("out", "grad", "w1_grad")) for r in results)
    print(f"max |EP - LLEP| over outputs, input and w1 gradients: {diff:.2e}")
    print(
        f"RESULT ep_max_over_mean={figures['ep'][0]:.3f} llep_max_over_mean={figures['llep'][0]:.3f} "
        f"ep_peak_act_mb={figures['ep'][1]:.2f} llep_peak_act_mb={figures['llep'][1]:.2f} "
        f"peak_act_ratio={figures['ep'][1] / figures['llep'][1]:.2f} max_abs_diff={diff:.1e}"
    )


if __name__ == "__main__":
    main()
