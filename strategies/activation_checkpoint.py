"""Activation checkpointing per transformer block: keep only block inputs, recompute the rest.

Source: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; the non-reentrant
``torch.utils.checkpoint.checkpoint``. Each chosen block's ``forward`` runs under checkpoint, so
its activations are freed after the forward and recomputed in the backward, trading about one
extra block forward for the activation memory of the block. ``selective`` (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"; torch's
``create_selective_checkpoint_contexts``) checkpoints every block but keeps the outputs of its
matmuls and attention kernels: only the cheap elementwise ops (norms, RoPE, SiLU) are recomputed.

The block is not wrapped in another module (as ``checkpoint_wrapper`` does): parameter names,
``state_dict`` keys and the optimizer's flattened state stay exactly as without checkpointing, so a
checkpoint saved with activation checkpointing on loads with it off and the other way round, and
name-based settings (``train.no_decay``) see the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

Mode = Literal["none", "full", "every_k", "selective"]
MODES: tuple[str, ...] = get_args(Mode)

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the matmuls and every fused attention kernel.
SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.linear.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        getattr(torch.ops.higher_order, "flex_attention", None),
    )
    if op is not None
)


def _save_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls_and_attention)


def _checkpointed_forward(block: nn.Module, *args: Any, selective: bool = False, **kwargs: Any) -> Any:
    # The class's forward runs under checkpoint; module hooks (FSDP's unshard/reshard) stay
    # outside it, so the recomputation in backward does not run them a second time.
    # Non-reentrant: works with keyword arguments, inputs that need no grad, FSDP2 and compile.
    if selective:
        return checkpoint(
            type(block).forward, block, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs
        )
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def _check(mode: str, every_k: int) -> None:
    if mode not in MODES:
        raise ValueError(f"strategy.activation_checkpoint.mode={mode!r} is unknown; use one of {', '.join(MODES)}")
    if every_k < 1:
        raise ValueError(f"strategy.activation_checkpoint.every_k={every_k} must be >= 1")


def is_checkpointed(block: nn.Module) -> bool:
    """True if `apply_activation_checkpointing` has made ``block`` run under checkpoint."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func is _checkpointed_forward


def apply_activation_checkpointing(model: nn.Module, *, mode: Mode, every_k: int = 1) -> list[str]:
    """Runs the forward of the blocks in ``model.layers`` under activation checkpointing, in place.

    Args:
        model: a module with an ``nn.ModuleDict``/``ModuleList`` named ``layers``.
        mode: "none" (nothing), "full" (every block), "selective" (every block, keeping the outputs
            of matmuls and attention: `SAVED_OPS`) or "every_k" (blocks 0, k, 2k, ...; the
            others keep their activations and are not recomputed: less memory saved, less time lost).
        every_k: the k of "every_k"; ignored by the other modes.

    Returns:
        The names (keys in ``model.layers``) of the checkpointed blocks.

    Raises:
        ValueError: an unknown mode or ``every_k < 1``.
    """
    _check(mode, every_k)
    if mode == "none":
        return []
    step = every_k if mode == "every_k" else 1
    chosen = list(model.layers.named_children())[::step]
    for _, block in chosen:
        if not is_checkpointed(block):
            # An instance attribute shadows the class's forward and nn.Module.__call__ calls it.
            # A partial (not a closure) so that deepcopy and pickle rebind it to the copied block.
            block.forward = partial(_checkpointed_forward, block, selective=mode == "selective")
    return [name for name, _ in chosen]


@dataclass
class ActivationCheckpoint(StrategyPlugin):
    """The activation-checkpointing plugin: settings of `apply_activation_checkpointing`.

    Args:
        mode: "none", "full" (every block), "selective" (every block, matmul and attention
            outputs kept) or "every_k" (every k-th block, from the first).
        every_k: k for mode "every_k".
    """

    mode: Mode = "none"
    every_k: int = 1

    def __post_init__(self) -> None:
        _check(self.mode, self.every_k)  # at build time, before any process starts

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """None: the mode and k are checked on construction."""
        return []

    def apply(self, model: nn.Module, meshes: Meshes | None = None) -> list[str]:
        """Checkpoints the chosen blocks of ``model``; returns their names."""
        return apply_activation_checkpointing(model, mode=self.mode, every_k=self.every_k)
