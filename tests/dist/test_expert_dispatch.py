"""Expert parallelism's row exchange in real gloo ranks (2 and 4): standard EP against a per-token
loop written here on all ranks' tokens, and LLEP against standard EP under a 95% skew.

Each rank routes its own 48 tokens (top-2 over 8 experts; 95% of the first choices go to expert 0,
which rank 0 owns) through `GroupedExperts` sharded by `strategies.expert.plugin.apply_expert_parallel`.
Outputs, input gradients and every expert weight's gradient are compared in fp32.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

E, K, D, FF, N = 8, 2, 16, 24, 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skewed_routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, D, generator=g)
    first = torch.where(torch.rand(N, generator=g) < 0.95, 0, torch.randint(1, E, (N,), generator=g))
    second = (first + torch.randint(1, E, (N,), generator=g)) % E
    weights = torch.rand(N, K, generator=g)
    return x, torch.stack([first, second], 1), weights / weights.sum(1, keepdim=True)


def _full_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(E, FF, D, generator=g) / 4,
        torch.randn(E, D, FF, generator=g) / 5,
        torch.randn(E, FF, D, generator=g) / 4,
    ]


def _reference(x_nd, experts_nk, weights_nk, w1, w2, w3):
    """Token by token: the weighted sum of its K experts' SwiGLUs."""
    rows = []
    for x, chosen, wts in zip(x_nd, experts_nk.tolist(), weights_nk):
        rows.append(sum(wt * (w2[e] @ (F.silu(w1[e] @ x) * (w3[e] @ x))) for wt, e in zip(wts, chosen)))
    return torch.stack(rows)


def _run_layer(experts, x, experts_nk, weights_nk):
    from trainer.models.moe import combine, sort_by_expert

    x = x.clone().requires_grad_()
    order, counts = sort_by_expert(experts_nk, E)
    out = combine(experts(x[order // K], counts), order, weights_nk)
    out.backward(torch.ones_like(out) * torch.arange(D) / D)  # a fixed, non-uniform output gradient
    grads = [getattr(experts, n).grad.full_tensor() for n in ("w1", "w2", "w3")]
    return out.detach(), x.grad, grads


def _forward(experts, x, experts_nk, weights_nk):
    from trainer.models.moe import sort_by_expert

    order, counts = sort_by_expert(experts_nk, E)
    return experts(x[order // K], counts)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from strategies.expert.plugin import ExpertParallel, apply_expert_parallel
        from trainer.models.moe import GroupedExperts

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        x, experts_nk, weights_nk = _skewed_routing(rank)
        results = {}
        for name, plugin in [
            ("ep", ExpertParallel(ep=world)),
            ("llep", ExpertParallel(ep=world, least_loaded=True, capacity_ratio=1.1, min_tokens_per_gemm=1)),
        ]:
            experts = GroupedExperts(D, FF, E)
            with torch.no_grad():
                for p, w in zip((experts.w1, experts.w2, experts.w3), _full_weights()):
                    p.copy_(w)
            apply_expert_parallel(experts, mesh, plugin.dispatcher(mesh.get_group()))
            results[name] = _run_layer(experts, x, experts_nk, weights_nk)
            with torch.no_grad():  # an evaluation's or a rollout's forward: not a training step's load
                _forward(experts, x, experts_nk, weights_nk)
            # Activation checkpointing's recompute in backward: the same forward, not counted again.
            xc = x.clone().requires_grad_()
            out = checkpoint(_forward, experts, xc, experts_nk, weights_nk, use_reentrant=False)
            out.sum().backward()
            for p in (experts.w1, experts.w2, experts.w3):
                p.grad = None
            results[name + "_loads"] = experts.dispatcher.pop_rank_loads()

        # The reference sees every rank's tokens; this rank checks its own rows and the summed grads.
        everything = [None] * world
        dist.all_gather_object(everything, (x, experts_nk, weights_nk))
        ws = [w.requires_grad_() for w in _full_weights()]
        xs = [t[0].clone().requires_grad_() for t in everything]
        refs = [_reference(xi, t[1], t[2], *ws) for xi, t in zip(xs, everything)]
        sum((r * torch.arange(D) / D).sum() for r in refs).backward()
        reference = (refs[rank].detach(), xs[rank].grad, [w.grad for w in ws])
        torch.save((rank, results, reference), f"{out_dir}/rank{rank}.pt")
    except Exception:  # reported to the test rather than lost in a child process
        torch.save((rank, traceback.format_exc(), None), f"{out_dir}/rank{rank}.pt")
    finally:
        os._exit(0)  # results are on disk: skip gloo's teardown (it sometimes aborts)


def _launch(world: int, out_dir) -> list:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    out = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank, results, _ in out:
        assert not isinstance(results, str), f"rank {rank} failed:\n{results}"
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ep_equals_a_per_token_loop_and_llep_equals_ep_under_skew(world, tmp_path):
    for rank, results, (ref_out, ref_xgrad, ref_wgrads) in _launch(world, tmp_path):
        out, xgrad, wgrads = results["ep"]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xgrad, ref_xgrad, rtol=1e-5, atol=1e-5)
        for got, ref in zip(wgrads, ref_wgrads):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        ll_out, ll_xgrad, ll_wgrads = results["llep"]
        torch.testing.assert_close(ll_out, out, rtol=0, atol=1e-6)
        torch.testing.assert_close(ll_xgrad, xgrad, rtol=0, atol=1e-6)
        for got, ref in zip(ll_wgrads, wgrads):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # sums of ~90 rows ~3: a few ulps
        # One row per training forward (_run_layer's, the checkpointed one's): neither the no-grad forward nor
        # the recompute in backward counts (both were mixed into ep/max_over_mean_rows).
        assert results["ep_loads"].shape[0] == results["llep_loads"].shape[0] == 2  # _run_layer's, checkpoint's
        ep_loads, ll_loads = results["ep_loads"][0].float(), results["llep_loads"][0].float()
        mean = ep_loads.mean()
        assert ll_loads.sum() == ep_loads.sum() == world * N * K
        assert ep_loads.max() > 1.4 * mean  # the skew breaks the cap under standard EP ...
        assert ll_loads.max() <= 1.1 * mean  # ... and LLEP caps every rank at ratio x mean
