"""Activation offload: the tensors a block saves for backward live in CPU memory until the backward.

Source: ``torch.autograd.graph.save_on_cpu`` (the pack/unpack saved-tensor hooks of
Rhu et al. 2016, "vDNN", in PyTorch's public API). For long contexts on accelerators, where
activations, not parameters, fill the device memory. On a CPU-only run it only adds a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def apply_activation_offload(model: nn.Module) -> int:
    """Runs the forward of each block in ``model.layers`` under ``save_on_cpu``, in place.

    Forward pre/post hooks (not a forward wrapper) so that activation checkpointing, which calls
    the class's forward, keeps it: the block's checkpointed inputs are then offloaded too.

    Returns:
        The number of blocks hooked.
    """
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    pin = torch.cuda.is_available()
    for block in blocks:
        contexts: list[Any] = []

        def enter(module: nn.Module, args: Any, contexts: list[Any] = contexts) -> None:
            contexts.append(torch.autograd.graph.save_on_cpu(pin_memory=pin))
            contexts[-1].__enter__()

        def leave(module: nn.Module, args: Any, output: Any, contexts: list[Any] = contexts) -> None:
            contexts.pop().__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    return len(blocks)


@dataclass
class ActivationOffload(StrategyPlugin):
    """The activation-offload plugin (``strategy.activation_offload.enabled``).

    Args:
        enabled: keep the tensors each block saves for backward in CPU memory (`apply_activation_offload`).
    """

    enabled: bool = False

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """None: offloading fits every layout (on a CPU-only run it only adds a copy)."""
        return []

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> None:
        if self.enabled:
            apply_activation_offload(model)
