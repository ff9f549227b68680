"""Sparsity-accelerated training (SAT): each step, skip a fraction of every MLP's hidden channels.

Source: Ma, Chen, Wang, ... Yu 2024, "Sparsity-Accelerated Training for Large Language Models"
(Findings of ACL; code OpenDFM/SAT). In continued pre-training and fine-tuning of a pretrained
model many MLP neurons are nearly inactive, so each step SAT omits a fraction ``rate`` of the MLP
hidden channels: the forward gathers only the kept rows of the gate/up projections and the kept
columns of the down projection, so both forward and backward do ``(1 - rate)`` of the MLP's matmul
work, and the omitted channels get no gradient that step.

What is implemented: the MLP omission with a per-step uniformly random channel subset per block,
drawn from (``seed``, step, block name), so every rank of a step keeps the same channels (data-
parallel replicas, pipeline stages and activation-checkpoint recomputation agree) and a run is
reproducible. Not implemented: the paper's importance-weighted selection, its attention-head
omission and its ladder omission-rate schedule. At ``rate=0`` nothing is omitted and training is
exactly dense.

The model declares the capability: a module with ``ffn_dim`` and ``keep_channels(idx | None)``
(`SparseMLP`, e.g. `trainer.models.block.FeedForward`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from strategies.parallel_dims import Meshes
    from strategies.resolved import ResolvedRun
    from strategies.shape import ModelShape


@runtime_checkable
class SparseMLP(Protocol):
    """An MLP whose hidden channels can be restricted for the next forwards."""

    ffn_dim: int

    def keep_channels(self, idx_f: torch.Tensor | None) -> None: ...


def kept_channels(ffn_dim: int, rate: float, *, seed: int, step: int, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``round((1 - rate) * ffn_dim)`` kept channels of one MLP at one step, sorted ([F'] int64).

    A uniformly random subset from a generator seeded by (seed, step, name): the same on every rank.
    """
    keep = max(1, round((1.0 - rate) * ffn_dim))
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4_294_967_311 + zlib.crc32(name.encode())) % 2**63)
    idx = torch.randperm(ffn_dim, generator=generator)[:keep]
    return idx.sort().values.to(device)


def sparse_mlps(model: nn.Module) -> dict[str, SparseMLP]:
    """Every `SparseMLP` in ``model`` (a pipeline stage holds its own blocks only), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparseMLP)}


class SAT:
    """The SAT plugin: ``+strategy/sat=default strategy.sat.rate=0.5`` (see the module docstring).

    Args:
        rate: fraction of each MLP's hidden channels omitted per step, in [0, 1).
        seed: seed of the channel draws.

    Raises:
        ValueError: ``rate`` outside [0, 1).
    """

    def __init__(self, rate: float = 0.5, seed: int = 0) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"strategy.sat.rate={rate} must be in [0, 1)")
        self.rate, self.seed = float(rate), int(seed)
        self.mlps: dict[str, SparseMLP] = {}

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Configuration problems, each naming the fix (``run.dims``: the resolved degrees)."""
        out = []
        if not 0.0 <= self.rate < 1.0:
            out.append(f"strategy.sat.rate={self.rate} must be in [0, 1)")
        dims = run.dims
        if dims.tp > 1:
            out.append(
                f"strategy.sat with strategy.tp={dims.tp}: SAT's channel slicing of the tensor-parallel MLP "
                "shards is not implemented; use strategy.tp=1 or strategy.sat=null"
            )
        return out

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        """Finds the model's sparse MLPs.

        Raises:
            ValueError: the model has none (it does not declare ``keep_channels``).
        """
        self.mlps = sparse_mlps(model)
        if not self.mlps and any(True for _ in model.parameters()):
            raise ValueError(f"strategy.sat: {type(model).__name__} has no MLP with keep_channels(); use strategy.sat=null")

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The forward and backward of optimizer step ``step`` run inside with the step's channels."""
        if self.rate > 0.0:
            for name, mlp in self.mlps.items():
                device = next(iter(mlp.parameters())).device if isinstance(mlp, nn.Module) else "cpu"
                mlp.keep_channels(kept_channels(mlp.ffn_dim, self.rate, seed=self.seed, step=step, name=name, device=device))
        try:
            yield
        finally:
            for mlp in self.mlps.values():
                mlp.keep_channels(None)
