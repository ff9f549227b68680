"""``torch.compile`` per transformer block.

Compiling each block rather than the whole model keeps graphs small (every block has the same
code, so one compiled graph serves all of them), lets FSDP2 put its all-gather and reduce-scatter
between blocks, and composes with activation checkpointing inside the block. ``Module.compile``
compiles in place, so parameter names and checkpoints are the same as without compile (no
``_orig_mod`` prefix, unlike ``torch.compile(module)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def apply_compile(model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False) -> None:
    """Compiles every block in ``model.layers`` in place with ``torch.compile``.

    Args:
        model: a module with an ``nn.ModuleDict``/``ModuleList`` named ``layers``.
        backend: a ``torch.compile`` backend: "inductor" (generated kernels), "aot_eager"
            (traced but not code-generated: checks graphs fast), ...
        fullgraph: fail on any graph break instead of falling back to eager for that part.
    """
    for block in model.layers.children():
        block.compile(backend=backend, fullgraph=fullgraph)


@dataclass
class Compile(StrategyPlugin):
    """The compile plugin: whether and how `apply_compile` compiles the blocks.

    Args:
        enabled: compile the blocks (the first steps then include the compile time).
        backend: ``torch.compile`` backend.
        fullgraph: fail on graph breaks.
    """

    enabled: bool = False
    backend: str = "inductor"
    fullgraph: bool = False

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """A ``backend`` torch does not know, when enabled (else it would fail at the first step)."""
        if not self.enabled:
            return []
        from torch._dynamo import list_backends  # imported only when compiling: dynamo is slow to import

        if self.backend in list_backends(exclude_tags=()):  # the debugging ones too (aot_eager, eager)
            return []
        usual = ", ".join(sorted({*list_backends(), "aot_eager", "eager"}))
        return [f"strategy.compile.backend={self.backend!r} is not a torch.compile backend; use one of {usual}"]

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        if self.enabled:
            apply_compile(model, backend=self.backend, fullgraph=self.fullgraph)
