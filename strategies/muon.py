"""Muon for the hidden matrices, AdamW for the rest, in one optimizer; distributed without a full gather.

Muon (Keller Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
https://kellerjordan.github.io/posts/muon/, github.com/KellerJordan/Muon ``muon.py``): per 2-D
hidden matrix, Nesterov momentum, then the update's nearest semi-orthogonal matrix by 5 steps of
the quintic Newton-Schulz iteration with coefficients (3.4445, -4.7750, 2.0315), scaled by its
shape. The embeddings, the LM head, norms and biases take AdamW, as the reference recipes do.

Distributed (`orthogonalize`): Newton-Schulz needs the whole matrix, FSDP2 and TP hold shards
(DTensors). As in Microsoft's Dion ``dion/muon.py`` (distributed Muon for FSDP2, also in torchtitan
``experiments/dion_optimizer``), the matrices sharded over one mesh axis are taken in batches of
that axis's size: one ``all_to_all`` gives rank j of the axis the whole j-th matrix of the batch
(each rank sends each owner its shard), the owner orthogonalises it, and a second ``all_to_all``
returns each rank its shard of the result. No rank gathers a matrix it does not own. Matrices
sharded over two axes (FSDP x TP) are stacked and re-sharded by DTensor itself over the batch
dimension (``redistribute``; all_to_all on NCCL, an all-gather fallback on gloo). Momentum and
AdamW's moments stay sharded like the parameters: DCP saves and reshards them like AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from strategies.runtime.collective_device import collective_device

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steepest slope at 0
# The embedding and the LM head (plait's Llama names), and biases: GPT-OSS's stacked expert biases
# ([E, F]) are 2-D, not matrices of a linear map.
ADAMW_PARAMS = ("tok_embeddings", "output", "bias")
Scale = Literal["match_rms_adamw", "original"]


def takes_muon(name: str, ndim: int, adamw_params: Sequence[str] = ADAMW_PARAMS) -> bool:
    """Whether a parameter is a hidden matrix for Muon: 2-D and no entry of ``adamw_params`` in its name
    (the optimizer's rule, which the planner's state and time counts share)."""
    return ndim == 2 and not any(s in name for s in adamw_params)


def expert_line(params: Iterable[tuple[str, Sequence[int]]], adamw_params: Sequence[str] = ADAMW_PARAMS) -> str | None:
    """The launch line of ``optim=muon`` on a model with 3-D (stacked expert) weights, which Muon
    does not take (its rule: `takes_muon`) and AdamW does: the shares of the parameters each takes;
    None without such weights. ``params``: ``(name, shape)`` of every parameter."""
    sizes = {"muon": 0, "experts": 0, "all": 0}
    for name, shape in params:
        n = math.prod(shape)
        sizes["all"] += n
        sizes["muon"] += n if takes_muon(name, len(shape), adamw_params) else 0
        sizes["experts"] += n if len(shape) == 3 and not any(s in name for s in adamw_params) else 0
    if not sizes["experts"]:
        return None
    share = {k: f"{100 * v / sizes['all']:.0f}%" for k, v in sizes.items()}
    return (
        f"optim=muon: Muon takes the 2-D matrices ({share['muon']} of the parameters); AdamW takes the 3-D expert "
        f"weights ({share['experts']}) with the embedding, head, norms and biases (docs/running.md, Muon)"
    )


def launch_line(optimizer: Any, params: Iterable[tuple[str, Sequence[int]]], *, adapters: bool = False) -> str | None:
    """When ``optimizer`` (the run's optimizer partial) builds `Muon`: with LoRA ``adapters`` (the only
    trainable parameters, each 2-D) that Muon takes them, else `expert_line`; None for another optimizer."""
    target = getattr(optimizer, "func", optimizer)
    if not (isinstance(target, type) and issubclass(target, Muon)):
        return None
    if adapters:
        return (
            "optim=muon with strategy.lora: the adapters are what trains, and Muon orthogonalises each lora_A and "
            "lora_B update (2-D matrices of the LoRA rank); optim=adamw is LoRA's usual optimizer"
        )
    return expert_line(params, adamw_params_of(optimizer))


def adamw_params_of(optimizer: Any) -> tuple[str, ...]:
    """The ``adamw_params`` (`Muon`'s name substrings of the 2-D parameters left to AdamW) that the
    run's optimizer partial sets (``optim.adamw_params``), else `ADAMW_PARAMS`, Muon's default."""
    return tuple(getattr(optimizer, "keywords", {}).get("adamw_params", ADAMW_PARAMS))


def newton_schulz(
    g: torch.Tensor, *, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration: about ``U V^T`` of ``g = U S V^T`` (singular values ~[0.7, 1.2]).

    Keller Jordan's ``zeropower_via_newtonschulz5``: the iteration runs on the wide orientation
    (``A <= B``), after scaling ``g`` to Frobenius norm 1 so that every singular value is <= 1.

    Args:
        g: ``[A, B]`` matrix.
        steps: iterations.
        dtype: the iteration's dtype (bf16 in the reference; fp32 rounds less).
        eps: floor of the norm (an all-zero ``g`` returns zeros).

    Returns:
        ``[A, B]`` in ``dtype``.
    """
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.mT
    x = x / (x.norm() + eps)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT  # [A, A]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


def update_scale(shape: Sequence[int], scale: Scale) -> float:
    """Factor on the learning rate of a ``[A, B]`` matrix's orthogonalised update.

    ``match_rms_adamw``: ``0.2 * sqrt(max(A, B))`` (Liu et al. 2025, "Muon is Scalable for LLM
    Training", Moonlight): the update's RMS matches AdamW's (~0.2), so AdamW's learning rate and
    weight decay carry over. ``original``: ``sqrt(max(1, A / B))`` (Keller Jordan's ``muon.py``).
    """
    rows, cols = shape[0], shape[1]
    if scale == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"optim.scale={scale!r} is unknown; use match_rms_adamw or original")


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of `newton_schulz` on a ``[A, B]`` matrix: per step ``X X^T`` and ``(.) X`` (``A x B x A``
    and ``A x A x B``) and the Gram matrix's square (``A x A x A``), with ``A <= B``."""
    small, large = sorted(shape[:2])
    return steps * 2 * (2 * small * small * large + small**3)


# ---------------------------------------------------------------------------------- distributed
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_axis(t: DTensor) -> tuple[int, int] | None:
    """``(mesh axis, tensor dim)`` of a DTensor sharded (plain `Shard`) over exactly one mesh axis and
    replicated over the others; None for any other layout."""
    shards = [(axis, p.dim) for axis, p in enumerate(t.placements) if type(p) is Shard]
    others_replicated = all(type(p) is Shard or isinstance(p, Replicate) for p in t.placements)
    return shards[0] if len(shards) == 1 and others_replicated else None


def _chunks(size: int, parts: int) -> list[int]:
    """Lengths of ``torch.chunk(range(size), parts)`` padded to ``parts`` entries (DTensor's `Shard`)."""
    step = -(-size // parts)
    return [max(0, min(size, (i + 1) * step) - i * step) for i in range(parts)]


def _shard_shapes(shape: Sequence[int], dim: int, parts: int) -> list[list[int]]:
    return [[n if d == dim else shape[d] for d in range(len(shape))] for n in _chunks(shape[dim], parts)]


def _all_to_all(send: list[torch.Tensor], recv_numels: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """One ``all_to_all_single``: ``send[i]`` goes to rank i of ``group``; returns what rank i sent here (flat)."""
    device = collective_device(group, send[0].device)
    flat = torch.cat([t.reshape(-1) for t in send]).to(device)
    out = flat.new_empty(sum(recv_numels))
    dist.all_to_all_single(out, flat, recv_numels, [t.numel() for t in send], group=group)
    return list(out.to(send[0].device).split(recv_numels))


def _orthogonalize_batch(updates: list[DTensor], axis: int, dim: int, ns: dict[str, Any]) -> list[torch.Tensor]:
    """`newton_schulz` of up to ``size(axis)`` matrices sharded on ``dim`` over mesh ``axis``: matrix j
    is orthogonalised whole on rank j of the axis; returns this rank's shard of each result."""
    mesh: DeviceMesh = updates[0].device_mesh
    group, me, size = mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis)
    locals_ = [_local(u).contiguous() for u in updates]
    empty = locals_[0].new_empty(0)
    mine = _shard_shapes(updates[me].shape, dim, size) if me < len(updates) else None
    # Each rank's shard of matrix j goes to its owner, rank j.
    send = [locals_[j] if j < len(updates) else empty for j in range(size)]
    pieces = _all_to_all(send, [math.prod(s) for s in mine] if mine else [0] * size, group)
    back = [empty] * size
    if mine is not None:
        whole = torch.cat([p.view(s) for p, s in zip(pieces, mine)], dim=dim)
        result = newton_schulz(whole, **ns).to(whole.dtype)
        back = [r.contiguous() for r in result.split([s[dim] for s in mine], dim=dim)]
    # The owner returns each rank its shard of the result.
    returned = _all_to_all(back, [t.numel() for t in send[: len(updates)]] + [0] * (size - len(updates)), group)
    return [r.view(t.shape) for r, t in zip(returned, locals_)]


def _orthogonalize_stacked(updates: list[DTensor], ns: dict[str, Any]) -> list[torch.Tensor]:
    """`newton_schulz` of up to ``mesh.size()`` equal-layout matrices sharded over several mesh axes:
    stacked, re-sharded over the batch dim (one whole matrix per rank), orthogonalised, sent back."""
    mesh = updates[0].device_mesh
    stacked = torch.stack(updates)
    owned = stacked.redistribute(mesh, [Shard(0)] * mesh.ndim)
    local = owned.to_local()
    result = torch.stack([newton_schulz(m, **ns).to(m.dtype) for m in local]) if local.numel() else local
    placed = DTensor.from_local(result, mesh, owned.placements, shape=stacked.shape, stride=stacked.stride())
    back = placed.redistribute(mesh, stacked.placements).to_local()
    return list(back.unbind(0))


def orthogonalize(updates: Sequence[torch.Tensor], *, steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`newton_schulz` of each full matrix in ``updates``; returns this rank's part (local shard) of each.

    Plain tensors and replicated DTensors are orthogonalised where they are. DTensors sharded
    over one mesh axis go in batches of that axis's size through two ``all_to_all`` (see the
    module docstring); other layouts through DTensor's ``redistribute``. Every rank of a mesh must
    call this with the same matrices in the same order (they do: it is the optimizer step).

    Args:
        updates: ``[A, B]`` matrices (plain or DTensor, each with its full shape ``[A, B]``).
        steps, dtype: of `newton_schulz`.
    """
    ns = {"steps": steps, "dtype": dtype}
    out: list[torch.Tensor | None] = [None] * len(updates)
    # Matrices exchanged together: over one mesh axis (any shapes) or stacked (one layout and shape).
    batches: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor) or all(isinstance(p, Replicate) for p in u.placements):
            local = _local(u)
            out[i] = newton_schulz(local, **ns).to(local.dtype)
            continue
        axis_dim = _sharded_axis(u)
        key = (id(u.device_mesh), axis_dim, None if axis_dim else (u.placements, tuple(u.shape)))
        batches.setdefault(key, []).append(i)
    for (_, axis_dim, _), members in batches.items():
        mesh = updates[members[0]].device_mesh
        size = mesh.size(axis_dim[0]) if axis_dim else mesh.size()
        for start in range(0, len(members), size):
            batch = members[start : start + size]
            parts = [updates[i] for i in batch]
            done = _orthogonalize_batch(parts, *axis_dim, ns) if axis_dim else _orthogonalize_stacked(parts, ns)
            for i, part in zip(batch, done):
                out[i] = part
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- the optimizer
class Muon(torch.optim.Optimizer):
    """Muon on the 2-D hidden matrices and AdamW on the other parameters, as one optimizer.

    A parameter goes to Muon iff it is 2-D and no entry of ``adamw_params`` is a substring of its
    name (`trainer.optim.build_optimizer` passes each group's ``param_names``; a plain list of
    tensors has none, and then every 2-D tensor goes to Muon). Each incoming group splits into a
    Muon and an AdamW group that keep its weight decay; groups carry ``use_muon``. One optimizer,
    so the LR schedule (every group's ``initial_lr``), clipping and checkpoints see it whole.

    Muon step of a matrix W with gradient G, momentum buffer M (Keller Jordan's ``muon.py``):
    ``M <- mu M + (1 - mu) G``; ``U = (1 - mu) G + mu M`` (Nesterov; ``U = M`` without);
    ``W <- (1 - lr wd) W - lr scale(A, B) NS(U)``. AdamW as ``torch.optim.AdamW`` (decoupled decay).

    Args:
        params: groups (``params``, ``param_names``, ``weight_decay``) or tensors.
        lr: peak learning rate of both kinds; Muon's update is scaled by `update_scale`.
        adamw_lr: AdamW's learning rate; None: ``lr`` (what ``scale=match_rms_adamw`` is made for).
        momentum: Muon's momentum coefficient mu.
        nesterov: Nesterov momentum (the reference default).
        ns_steps: Newton-Schulz iterations.
        ns_dtype: the iteration's dtype, "bfloat16" (the reference) or "float32".
        scale: "match_rms_adamw" (Moonlight's ``0.2 sqrt(max(A, B))``) or "original" (``sqrt(max(1, A/B))``).
        betas, eps: AdamW's.
        weight_decay: decoupled decay of groups that do not set their own.
        adamw_params: substrings of the names of 2-D parameters that take AdamW (embedding, LM head).

    Raises:
        ValueError: an unknown ``scale`` or ``ns_dtype``, or a negative setting.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        *,
        adamw_lr: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: Literal["bfloat16", "float32"] = "bfloat16",
        scale: Scale = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        adamw_params: Sequence[str] = ADAMW_PARAMS,
    ) -> None:
        update_scale((1, 1), scale)  # raises on an unknown rule
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"optim.ns_dtype={ns_dtype!r} is unknown; use bfloat16 or float32")
        settings = {"lr": lr, "adamw_lr": adamw_lr, "momentum": momentum, "ns_steps": ns_steps, "eps": eps}
        settings.update({"weight_decay": weight_decay, "betas": tuple(betas)})
        for key, value in settings.items():
            if value is not None and min(value if isinstance(value, tuple) else (value,)) < 0:
                raise ValueError(f"optim.{key}={value} must be >= 0")
        # As AdamW's: 1 leaves a momentum that never moves from 0 (the matrices do not train) and
        # divides AdamW's second moment by a bias correction of 0 (NaN weights after the first step).
        for key, value in (("momentum", (momentum,)), ("betas", tuple(betas))):
            if max(value) >= 1:
                raise ValueError(f"optim.{key}={value if key == 'betas' else momentum} must be below 1")
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
            "ns_dtype": ns_dtype, "scale": scale, "betas": tuple(betas), "eps": eps,
        }  # fmt: skip
        groups = []
        for group in _as_groups(params):
            names = group.pop("param_names", None) or [""] * len(group["params"])
            kinds: dict[bool, list] = {True: [], False: []}
            for name, p in zip(names, group["params"]):
                kinds[takes_muon(name, p.ndim, adamw_params)].append(p)
            for use_muon, members in kinds.items():
                if members:
                    own_lr = {} if use_muon or adamw_lr is None else {"lr": adamw_lr}
                    groups.append({**group, "params": members, "use_muon": use_muon, **own_lr})
        groups.sort(key=lambda g: not g["use_muon"])  # Muon's first: param_groups[0]["lr"] is the one logged
        super().__init__(groups, defaults)

    @staticmethod
    def lr_key(group: dict[str, Any]) -> str:
        """The ``optim`` key that sets ``group``'s learning rate: ``adamw_lr`` for AdamW's groups
        (``lr`` while it is null), which a resume's override of either sets
        (`trainer.resume_record.apply_overrides`). Read from ``use_muon``: a key of its own in the
        groups would be missing from the optimizer state of older checkpoints, which DCP then refuses."""
        return "lr" if group.get("use_muon", True) else "adamw_lr"

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group; the Muon matrices of all groups are orthogonalised together."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices: list[tuple[torch.Tensor, dict]] = []
        updates: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = _like_param(p.grad, p)
                if group["use_muon"]:
                    matrices.append((p, group))
                    updates.append(self._momentum(p, grad, group))
                else:
                    self._adamw(p, grad, group)
        if updates:
            steps, dtype = self.param_groups[0]["ns_steps"], getattr(torch, self.param_groups[0]["ns_dtype"])
            for (p, group), ortho in zip(matrices, orthogonalize(updates, steps=steps, dtype=dtype)):
                local = _local(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho, alpha=-group["lr"] * update_scale(p.shape, group["scale"]))
        return loss

    def _momentum(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """Updates ``p``'s momentum buffer; the matrix to orthogonalise (Nesterov: a step ahead)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, g, mu = _local(state["momentum_buffer"]), _local(grad), group["momentum"]
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        if not isinstance(p, DTensor):
            return update
        return DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

    def _adamw(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """One AdamW step of ``p`` (torch's single-tensor AdamW, on the local shard)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        (beta1, beta2), lr = group["betas"], group["lr"]
        local, g = _local(p), _local(grad)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        state["step"] += 1
        step = state["step"].item()
        local.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        local.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def _as_groups(params: Iterable[Any]) -> list[dict]:
    """``params`` as a list of group dicts (copies: the caller's dicts are left as they are)."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": list(g["params"])} for g in params]
    return [{"params": params}]


def _like_param(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``p``'s layout (a vocabulary-sharded embedding's gradient is whole on every tp rank)."""
    if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad
