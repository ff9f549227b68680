"""Sparsity-accelerated training (SAT): each step, skip a fraction of every MLP's hidden channels.

Source: Ma, Chen, Wang, ... Yu 2024, "Sparsity-Accelerated Training for Large Language Models"
(Findings of ACL; code OpenDFM/SAT). In continued pre-training and fine-tuning of a pretrained
model many MLP neurons are nearly inactive, so each step SAT omits a fraction ``rate`` of the MLP
hidden channels: the forward gathers only the kept rows of the gate/up projections and the kept
columns of the down projection, so both forward and backward do ``(1 - rate)`` of the MLP's matmul
work, and the omitted channels get no gradient that step.

What is implemented: the MLP omission with a per-step uniformly random channel subset per block,
drawn from (``seed``, step, block name), so every rank of a step keeps the same channels (data-
parallel replicas, pipeline stages and activation-checkpoint recomputation agree), a run is
reproducible and a resumed run draws what the uninterrupted one drew (the draw is a pure function
of the global step; nothing to checkpoint). The paper's ladder omission-rate scheduler (LORS):
``ladder`` lists phases ``[start_fraction, scale]`` of the run (``total_steps`` optimizer steps);
a step omits ``rate x scale`` of the phase it falls in, so the rate steps down towards the end and
the last phase trains dense (``scale`` 0). At omission rate 0 a step runs the dense code path and
is exactly dense training.

Not implemented: the paper's attention-head omission, and its importance-based selection. The
sources available here give the idea (score each channel from its activations and omit the least
important, by sampling) but not the rule (which norm, over which tokens, smoothed across steps or
not, top-k or sampled and from what distribution), and OpenDFM/SAT has no code. Built, it needs
the scores all-reduced over the data-parallel ranks before the draw (each rank sees other rows), and
any state smoothed across steps checkpointed with the optimizer (or resume refused).

The model declares the capability: a module with ``ffn_dim`` and ``keep_channels(idx | None)``
(`SparseMLP`, e.g. `trainer.models.block.FeedForward`).
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


@runtime_checkable
class SparseMLP(Protocol):
    """An MLP whose hidden channels can be restricted for the next forwards."""

    ffn_dim: int

    def keep_channels(self, idx_f: torch.Tensor | None) -> None: ...


def kept_channels(
    ffn_dim: int, rate: float, *, seed: int, step: int, name: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``round((1 - rate) * ffn_dim)`` kept channels of one MLP at one step, sorted ([F'] int64).

    A uniformly random subset from a generator seeded by (seed, step, name): the same on every rank.
    """
    keep = max(1, round((1.0 - rate) * ffn_dim))
    generator = torch.Generator().manual_seed(
        ((seed * 1_000_003 + step) * 4_294_967_311 + zlib.crc32(name.encode())) % 2**63
    )
    idx = torch.randperm(ffn_dim, generator=generator)[:keep]
    return idx.sort().values.to(device)


def sparse_mlps(model: nn.Module) -> dict[str, SparseMLP]:
    """Every `SparseMLP` in ``model`` (a pipeline stage holds its own blocks only), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparseMLP)}


def ladder_problems(ladder: Sequence[Sequence[float]], total_steps: int | None) -> list[str]:
    """What is wrong with a ladder of ``[start_fraction, scale]`` phases, each problem naming the fix
    (``total_steps`` None: the run's planned steps, told later)."""
    where = "strategy.sat.ladder"
    if total_steps is not None and total_steps <= 0:
        return [
            f"{where} needs strategy.sat.total_steps > 0 or null (the run's steps); set it or strategy.sat.ladder=null"
        ]
    if not ladder or any(len(phase) != 2 for phase in ladder):
        return [f"{where}={list(map(list, ladder))} must be a non-empty list of [start_fraction, scale] pairs"]
    starts, scales = [float(p[0]) for p in ladder], [float(p[1]) for p in ladder]
    out = []
    if starts[0] != 0.0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= 1.0:
        out.append(f"{where}: the start fractions {starts} must begin at 0.0 and increase, below 1.0")
    if any(not 0.0 <= x <= 1.0 for x in scales):
        out.append(f"{where}: the scales {scales} must be in [0, 1] (a phase omits strategy.sat.rate x scale)")
    return out


def ladder_rate(step: int, rate: float, ladder: Sequence[Sequence[float]] | None, total_steps: int) -> float:
    """The omission rate of optimizer step ``step`` (0-based): ``rate`` x the scale of its phase.

    Step ``s`` is in the last phase whose ``start_fraction x total_steps <= s``; no ladder: ``rate``.
    """
    if ladder is None:
        return rate
    scale = [float(x) for start, x in ladder if float(start) * total_steps <= step][-1]
    return rate * scale


class SAT(StrategyPlugin):
    """The SAT plugin: ``+strategy/sat=default [strategy.sat.rate=0.5]`` (see the module docstring).

    Args:
        rate: fraction of each MLP's hidden channels omitted per step (the ladder's top rung), in [0, 1).
        seed: seed of the channel draws.
        ladder: phases ``[[start_fraction, scale], ...]`` of the run, fractions increasing from 0.0
            (the preset: the paper's ladder, dense at the end); None: ``rate`` at every step.
        total_steps: the optimizer steps ``ladder``'s fractions divide; None (the preset): the run's
            planned steps, as the LR schedule spans them (`run_length`: ``trainer.max_steps``, or
            fewer when the data ends first). A resume with another ``trainer.max_steps`` moves the
            rungs, as it moves the LR schedule.

    Raises:
        ValueError: ``rate`` outside [0, 1), or a malformed ``ladder``.
    """

    def __init__(
        self,
        rate: float = 0.5,
        seed: int = 0,
        ladder: Sequence[Sequence[float]] | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.rate, self.seed = float(rate), int(seed)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.ladder = None if ladder is None else [[float(a), float(b)] for a, b in ladder]
        if problems := self._rate_problems():
            raise ValueError("; ".join(problems))
        self.mlps: dict[str, SparseMLP] = {}
        self.float8: Any = None  # the float8 plugin, if configured (`peers`)

    def _rate_problems(self) -> list[str]:
        out = [] if 0.0 <= self.rate < 1.0 else [f"strategy.sat.rate={self.rate} must be in [0, 1)"]
        return out + ([] if self.ladder is None else ladder_problems(self.ladder, self.total_steps))

    def run_length(self, total_steps: int) -> None:
        """The run's planned steps: the ladder's ``total_steps`` unless the config set it."""
        if self.total_steps is None:
            self.total_steps = total_steps

    def rate_at(self, step: int) -> float:
        """The omission rate of optimizer step ``step`` (0-based global step).

        Raises:
            RuntimeError: a ladder whose ``total_steps`` was neither set nor told (`run_length`).
        """
        if self.ladder is not None and self.total_steps is None:
            raise RuntimeError("strategy.sat.ladder: the run's length was not told (SAT.run_length); set total_steps")
        return ladder_rate(step, self.rate, self.ladder, self.total_steps or 0)

    def peers(self, plugins: dict[str, Any]) -> None:
        self.float8 = plugins.get("float8")

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Configuration problems, each naming the fix (``run.dims``: the resolved degrees; ``run.compile``)."""
        out = self._rate_problems()
        if getattr(self.float8, "recipe", None) is not None:
            out.append(
                "strategy.sat slices the MLP weights into plain matmuls, not float8 ones (the MLPs would run in high "
                "precision, or crash on a float8 all-gather); set strategy.float8.recipe=null or strategy.sat=null"
            )
        if run.compile:
            out.append("strategy.sat with strategy.compile.enabled=true is not supported; set one of them off")
        dims = run.dims
        if dims.tp > 1:
            out.append(
                f"strategy.sat with strategy.tp={dims.tp}: SAT's channel slicing of the tensor-parallel MLP "
                "shards is not implemented; use strategy.tp=1 or strategy.sat=null"
            )
        dense = shape is None or shape.num_shared_experts or any(not shape.is_moe(i) for i in range(shape.n_layers))
        if not dense:
            out.append(
                "strategy.sat omits hidden channels of dense MLPs (shared experts included), and this model has none: "
                "every block is a mixture of routed experts, which SAT leaves dense; use a model with dense MLPs "
                "(or shared experts), or strategy.sat=null"
            )
        return out

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        """Finds the model's sparse MLPs.

        Raises:
            ValueError: the model has none (it does not declare ``keep_channels``).
        """
        self.mlps = sparse_mlps(model)
        stage = meshes is not None and meshes["pp"].size() > 1  # this rank's blocks only
        if stage and not self.mlps:  # a stage of routed-expert blocks (validate saw the whole model's dense MLPs)
            pp, *others = meshes.root.get_coordinate() or [0]
            if not any(others):  # once per stage
                print(
                    f"plait: warning: strategy.sat: pipeline stage {pp} holds no dense MLP (routed experts only); "
                    "its blocks train dense",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if not self.mlps and any(True for _ in model.parameters()):
            raise ValueError(
                f"strategy.sat: {type(model).__name__} has no MLP with keep_channels(); use strategy.sat=null"
            )
        if moe := sum(1 for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)):
            self.say(
                f"warning: strategy.sat sparsifies the {len(self.mlps)} dense MLP(s) only (shared experts included); the "
                f"routed experts of the {moe} mixture-of-experts block(s) stay dense"
            )

    def step_context(self, step: int) -> AbstractContextManager[None]:
        """`step`."""
        return self.step(step)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """The forward and backward of optimizer step ``step`` run inside with the step's channels."""
        rate = self.rate_at(step)
        if rate > 0.0:
            for name, mlp in self.mlps.items():
                device = next(iter(mlp.parameters())).device if isinstance(mlp, nn.Module) else "cpu"
                mlp.keep_channels(kept_channels(mlp.ffn_dim, rate, seed=self.seed, step=step, name=name, device=device))
        try:
            yield
        finally:
            for mlp in self.mlps.values():
                mlp.keep_channels(None)
