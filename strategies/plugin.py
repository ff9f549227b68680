"""`Plugin`: the contract every technique plugin of `strategies.mesh.MeshStrategy` implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from strategies.parallel_dims import Meshes
from strategies.resolved import ResolvedRun
from strategies.shape import ModelShape


@runtime_checkable
class Plugin(Protocol):
    """What every technique plugin implements (FSDP, TP, CP, activation offload, AC, compile, PP,
    local SGD, and the ones you add): its problems for a run, found before any process starts, and
    its application to the model on the run's mesh."""

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Messages (each naming the fix) of what in ``run`` / ``shape`` this plugin cannot run; [] if it fits."""
        ...

    def apply(self, model: nn.Module, meshes: Meshes) -> Any:
        """Applies the technique to ``model`` in place."""
        ...
