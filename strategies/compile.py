"""``torch.compile`` per transformer block (``scope=block``) or of the whole model (``scope=model``).

Compiling each block rather than the whole model keeps graphs small (every block has the same
code, so one compiled graph serves all of them), lets FSDP2 put its all-gather and reduce-scatter
between blocks, and composes with activation checkpointing inside the block. Compiling the whole
model (as LitGPT does) also fuses the embedding, the final norm and the LM head into the graph;
FSDP2's hooks then break it at every block (dynamo skips them), so under FSDP it is per-block
compile plus the model's ends. ``Module.compile`` compiles in place, so parameter names and
checkpoints are the same as without compile (no ``_orig_mod`` prefix, unlike ``torch.compile(module)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


# What the model scope cannot compile as one graph yet, and why (the block scope runs there).
_MODEL_SCOPE_REFUSED = {
    "pp": "the pipeline schedule runs each stage's module, not the model's forward",
    "cp": "context-parallel attention swaps the attention inside each block per step",
}


def _wait_for_collective(module: nn.Module, args: tuple, output: object) -> object:
    """Forward hook on the modules outside the compiled blocks: an ``AsyncCollectiveTensor`` output
    (a tensor-parallel module's all-reduce or reduce-scatter still in flight, e.g. the row-wise
    token embedding's) becomes a plain tensor before a compiled block takes it. Given to a compiled
    block as is, its gradient came back unwrapped and the embedding's DTensor redistribute failed in
    the first backward with torch 2.13 ("'Tensor' object has no attribute '_local_tensor'"). The copy
    (``clone``: any op waits and unwraps; ``wait()`` would cut the autograd graph) is of one
    ``[B, T, D]`` activation per step."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False, scope: Literal["block", "model"] = "block"
) -> None:
    """Compiles ``model`` in place with ``torch.compile``: every block in ``model.layers``, or the whole model.

    Args:
        model: a module with an ``nn.ModuleDict``/``ModuleList`` named ``layers``.
        backend: a ``torch.compile`` backend: "inductor" (generated kernels), "aot_eager"
            (traced but not code-generated: checks graphs fast), ...
        fullgraph: fail on any graph break instead of falling back to eager for that part.
        scope: "block" (one graph per block, shared by all of them) or "model" (the whole forward).

    Raises:
        ValueError: an unknown ``scope``.
    """
    if scope == "model":
        model.compile(backend=backend, fullgraph=fullgraph)
    elif scope == "block":
        for block in model.layers.children():
            block.compile(backend=backend, fullgraph=fullgraph)
        for name, module in model.named_children():
            # What feeds the first block (the embedding) and takes the last one's output; once per module.
            if name != "layers" and _wait_for_collective not in module._forward_hooks.values():
                module.register_forward_hook(_wait_for_collective)
    else:
        raise ValueError(f"strategy.compile.scope={scope!r} is unknown; use block or model")


@dataclass
class Compile(StrategyPlugin):
    """The compile plugin: whether and how `apply_compile` compiles the blocks.

    Args:
        enabled: compile (the first steps then include the compile time).
        backend: ``torch.compile`` backend.
        fullgraph: fail on graph breaks.
        scope: "block" (each transformer block) or "model" (the whole forward, one process,
            DDP, FSDP and tensor-parallel layouts).
    """

    enabled: bool = False
    backend: str = "inductor"
    fullgraph: bool = False
    scope: Literal["block", "model"] = "block"

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """A ``backend`` torch does not know, and ``scope=model`` on a layout it cannot
        compile as one graph (pipeline or context parallel), when enabled (else it would fail at the first step);
        ``scope=model`` without ``enabled``, which would compile nothing in silence."""
        if not self.enabled:
            if self.scope == "model":
                return [
                    "strategy.compile.scope=model compiles only with strategy.compile.enabled=true (compile is off "
                    "by default); add strategy.compile.enabled=true, or leave the scope out"
                ]
            return []
        refused = [
            f"strategy.compile.scope=model does not run with {axis}={getattr(run.dims, axis)} ({why}); "
            "use strategy.compile.scope=block"
            for axis, why in _MODEL_SCOPE_REFUSED.items()
            if self.scope == "model" and getattr(run.dims, axis) > 1
        ]
        if refused:
            return refused
        from torch._dynamo import list_backends  # imported only when compiling: dynamo is slow to import

        if self.backend in list_backends(exclude_tags=()):  # the debugging ones too (aot_eager, eager)
            return []
        usual = ", ".join(sorted({*list_backends(), "aot_eager", "eager"}))
        return [f"strategy.compile.backend={self.backend!r} is not a torch.compile backend; use one of {usual}"]

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        if self.enabled:
            apply_compile(model, backend=self.backend, fullgraph=self.fullgraph, scope=self.scope)
