"""Mixout: mix each weight with its pretrained value at probability p, for stable fine-tuning.

Source: Lee, Cho and Kang 2020, "Mixout: Effective Regularization to Finetune Large-scale
Pretrained Language Models" (ICLR). For a weight ``w`` with pretrained value ``u`` and an
elementwise mask ``M ~ Bernoulli(p)``, the forward uses

    w_mixed = (where(M, u, w) - p * u) / (1 - p),

so ``E[w_mixed] = w`` (the paper's rescaling), and the gradient reaching ``w`` is
``dL/dw_mixed * (1 - M) / (1 - p)`` (an element taken from ``u`` gets no gradient). The paper shows
this acts as an adaptive L2 pull towards ``u`` rather than towards 0 (dropout), which makes
fine-tuning large models on small sets far more stable across seeds.

How it runs here: one mask per optimizer step, shared by the step's micro-batches. Before the
step's forward the plugin overwrites each chosen parameter's local shard with ``w_mixed`` (saving
``w``); after its backward it restores ``w`` and rescales the gradient in place, before the global
gradient norm and the optimizer step. Everything is elementwise on each rank's shard, so it works
under FSDP2, tensor and pipeline parallelism alike. The mask of an element depends only on
(``seed``, step, parameter name, the element's index in the full tensor): it is the same on every
layout and world size, so a sharded run draws exactly the masks of one process. ``u`` is the
model as training starts from it: `apply` runs in `MeshStrategy.setup`, after ``model.init_from``
has been loaded and before a resumed run loads its checkpoint.

With LoRA (``strategy.lora``) the base is frozen and the trainable parameters are the adapters:
those are mixed, each with its value as training starts, so B (starting at 0) is an elementwise
dropout of B rescaled by 1/(1 - p) and A is pulled towards its initialisation; with independent
masks ``E[B_mixed A_mixed] = B A``, the current update.

Resuming (also the roll-backs of ``budget=msft``) is exact without saving ``u``: a resumed run
builds its model as the first run did (the same seeded init, the same ``model.init_from`` file
loaded bit for bit), so `apply` snapshots the same ``u`` before the checkpoint overwrites the
weights, the way LoRA's frozen base comes back from ``model.init_from``. Saving ``u`` instead would
double the checkpoint bytes of every mixed matrix. The mask stream needs no state either: it is
indexed by the optimizer step (``global_step``, restored on resume).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """Low 32 bits of ``x * c`` for int64 ``x`` in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (Appleby): a bijection of [0, 2^32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _fmix32_int(x: int) -> int:
    return int(_fmix32(torch.tensor(x & _M32, dtype=torch.int64)))


def global_index(param: torch.Tensor) -> torch.Tensor:
    """Row-major index in the full tensor of each element of this rank's shard (int64, the shard's shape).

    A DTensor's shard is one block of the full tensor (also FSDP2 over tensor parallelism, whose
    strided placement still gives each rank a contiguous block); its offsets come from the
    DTensor's checkpoint protocol (``__create_chunk_list__``, what torch.distributed.checkpoint uses).
    """
    if isinstance(param, DTensor):
        shape, local = tuple(param.shape), param.to_local()
        offsets = tuple(param.__create_chunk_list__()[0].offsets) if local.numel() else (0,) * len(shape)
    else:
        shape, local, offsets = tuple(param.shape), param, (0,) * param.dim()
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for dim in reversed(range(len(shape))):
        coords = torch.arange(local.shape[dim], dtype=torch.int64, device=local.device) + offsets[dim]
        index = index + (coords * stride).view(-1, *([1] * (len(shape) - 1 - dim)))
        stride *= shape[dim]
    return index.expand(local.shape)


def mixout_mask(param: torch.Tensor, p: float, *, seed: int, step: int, name: str) -> torch.Tensor:
    """The step's Bernoulli(p) mask of ``param``'s local shard (bool, the shard's shape).

    A counter-based draw: ``fmix32`` of (seed, step, crc32(name)) and each element's global index,
    so every layout and world size draws the same mask for the same element.
    """
    key1 = _fmix32_int(seed ^ _fmix32_int(step ^ _fmix32_int(zlib.crc32(name.encode()))))
    key2 = _fmix32_int(key1 ^ 0x9E3779B9)
    index = global_index(param)
    hi = (index >> 32) & _M32
    bits = _fmix32(_fmix32((index & _M32) ^ key1) ^ _fmix32(hi ^ key2))
    return bits < int(p * 2**32)


def mix_(weight: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor, p: float) -> None:
    """``weight <- (where(mask, anchor, weight) - p * anchor) / (1 - p)`` in place (local tensors)."""
    mixed = (torch.where(mask, anchor, weight) - p * anchor) / (1.0 - p)
    weight.copy_(mixed)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Mixout(StrategyPlugin):
    """The Mixout plugin: ``+strategy/mixout=default strategy.mixout.p=0.1`` (see the module docstring).

    Args:
        p: mixing probability, in [0, 1). 0 trains exactly as without the plugin.
        seed: seed of the masks (the same on every rank).
        targets: substrings of parameter names to mix; only matrices (ndim >= 2) are mixed. The
            default, every attention and MLP projection of the blocks, matches the paper (all
            linear layers of the encoder).

    Raises:
        ValueError: ``p`` outside [0, 1).
    """

    when = "setup"  # its anchors: the weights training starts from (after model.init_from, before a resume)

    def __init__(self, p: float = 0.1, seed: int = 0, targets: Sequence[str] = ("attention.", "feed_forward.")) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"strategy.mixout.p={p} must be in [0, 1)")
        self.p, self.seed, self.targets = float(p), int(seed), tuple(targets)
        self.params: dict[str, nn.Parameter] = {}
        self.anchors: dict[str, torch.Tensor] = {}

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Configuration problems, each naming the fix."""
        return [] if 0.0 <= self.p < 1.0 else [f"strategy.mixout.p={self.p} must be in [0, 1)"]

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        """Chooses the parameters to mix and snapshots their local shards as the anchors ``u``.

        Called by `MeshStrategy.setup`: after the parallelisms (it keeps their sharded objects)
        and ``model.init_from``, before a resumed run loads its checkpoint over the weights.
        """
        self.params = {
            name: param
            for name, param in model.named_parameters()
            if param.requires_grad and param.dim() >= 2 and any(t in name for t in self.targets)
        }
        with torch.no_grad():
            self.anchors = {n: _local(p).detach().clone() for n, p in self.params.items()}

    def step_context(self, step: int) -> AbstractContextManager[None]:
        """`step`."""
        return self.step(step)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Forward and backward of optimizer step ``step`` (0-based) run inside: mixed weights
        in, restored weights and rescaled gradients out.

        Raises:
            RuntimeError: `apply` has not run.
        """
        if self.params.keys() != self.anchors.keys():
            raise RuntimeError("strategy.mixout: Mixout.apply(model) must run before the first step")
        with torch.no_grad():
            saved, masks = {}, {}
            for name, param in self.params.items():
                weight = _local(param)
                masks[name] = mixout_mask(param, self.p, seed=self.seed, step=step, name=name)
                saved[name] = weight.clone()
                mix_(weight, self.anchors[name], masks[name], self.p)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    _local(param).copy_(saved[name])
                    if param.grad is not None:
                        grad = _local(param.grad)
                        grad.mul_(torch.where(masks[name], 0.0, 1.0 / (1.0 - self.p)).to(grad.dtype))
