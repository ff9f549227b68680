"""Optimizer parameter groups and learning-rate schedules.

Weight decay applies only to matmul weights: embeddings, norm gains and biases go into a group
with weight_decay=0 (case C16; Loshchilov and Hutter 2019 "Decoupled Weight Decay Regularization";
the Llama and GPT-3 recipes). Schedules step once per *optimizer* step (case C06). A
`strategies.muon.Muon` (``optim=muon``) also gets the parameters' names: it tells the hidden
matrices from the embedding and the LM head by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

from strategies.core.ranges import FRACTION, NON_NEGATIVE
from strategies.muon import Muon

DEFAULT_NO_DECAY = ("tok_embeddings", "norm", "bias")


def param_groups(
    model: nn.Module, *, weight_decay: float, no_decay: Sequence[str] = DEFAULT_NO_DECAY, names: bool = False
) -> list[dict]:
    """Splits trainable parameters into a decayed and a non-decayed group.

    A parameter is decayed iff it has at least 2 dims and no entry of ``no_decay`` is a substring
    of its name. Tied parameters appear once. A model holding both DTensor and plain parameters
    (tensor parallelism without FSDP: the blocks it replicates, an MoE feed-forward or latent
    attention, stay plain) gets each group split in two, DTensors first: torch's fused and foreach
    optimizers refuse a group that mixes them.

    Args:
        names: each group also lists its parameters' names under ``param_names``.

    Returns:
        ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]``,
        empty groups omitted.
    """
    decay: dict[str, nn.Parameter] = {}
    rest: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():  # named_parameters() yields a tied tensor once
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and not any(pattern in name for pattern in no_decay):
            decay[name] = param
        else:
            rest[name] = param
    groups = [(part, wd) for g, wd in ((decay, weight_decay), (rest, 0.0)) for part in _by_tensor_kind(g)]
    return [
        {"params": list(g.values()), "weight_decay": wd, **({"param_names": list(g)} if names else {})}
        for g, wd in groups
        if g
    ]


def _by_tensor_kind(params: dict[str, nn.Parameter]) -> list[dict[str, nn.Parameter]]:
    """``params`` whole when all are DTensors or none is; else its DTensors, then the others."""
    dtensors = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    if not dtensors or len(dtensors) == len(params):
        return [params]
    return [dtensors, {n: p for n, p in params.items() if n not in dtensors}]


def build_optimizer(
    model: nn.Module,
    optimizer: Callable[..., torch.optim.Optimizer],
    *,
    weight_decay: float,
    no_decay: Sequence[str] = DEFAULT_NO_DECAY,
) -> torch.optim.Optimizer:
    """``optimizer`` is a partial (Hydra ``_partial_: true``) taking param groups and the other kwargs; a
    `strategies.muon.Muon` gets the groups' ``param_names`` too."""
    target = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    names = isinstance(target, type) and issubclass(target, Muon)
    return optimizer(param_groups(model, weight_decay=weight_decay, no_decay=no_decay, names=names))


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR used by the optimizer step after ``step`` steps (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` (torchtitan's convention: the first step trains at
    ``1/warmup_steps`` of the peak, not at 0; step ``warmup_steps - 1`` reaches the peak), then
    "cosine" or "linear" decay to ``min_lr_ratio`` at ``total_steps``, or "constant": the peak to
    the end (``min_lr_ratio`` unused).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"scheduler.decay={decay!r} is unknown; use cosine, linear or constant")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class WarmupDecayLR(LRScheduler):
    """Warmup then cosine/linear/constant decay, as a stateful scheduler (checkpointed by Lightning).

    Args:
        optimizer: the wrapped optimizer; each group's ``initial_lr`` is its peak LR.
        total_steps: optimizer steps of the whole run (the trainer passes ``trainer.max_steps``).
        warmup_steps: steps of linear warmup; step 1 trains at ``1/warmup_steps`` of the peak.
        decay: "cosine", "linear" or "constant".
        min_lr_ratio: final LR as a fraction of the peak (cosine and linear; constant stays at the peak).

    Raises:
        ValueError: unknown decay, negative steps or a ratio outside [0, 1].
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        warmup_steps: Annotated[int, NON_NEGATIVE] = 0,
        decay: Literal["cosine", "linear", "constant"] = "cosine",
        min_lr_ratio: Annotated[float, FRACTION] = 0.1,
        last_epoch: int = -1,
    ) -> None:
        if decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"scheduler.decay={decay!r} is unknown; use cosine, linear or constant")
        if warmup_steps < 0 or total_steps < 0:
            raise ValueError("scheduler.warmup_steps and the trainer's max_steps must be >= 0")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.decay, self.min_lr_ratio = decay, min_lr_ratio
        super().__init__(optimizer, last_epoch)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the position (``last_epoch``) but keeps this run's schedule settings.

        A resumed run may extend ``trainer.max_steps`` or change the warmup/decay: the saved
        settings must not override the ones the run was started with now.
        """
        settings = {k: getattr(self, k) for k in ("total_steps", "warmup_steps", "decay", "min_lr_ratio")}
        super().load_state_dict(state_dict)
        self.__dict__.update(settings)

    def get_lr(self) -> list[float]:
        factor = lr_factor(
            self.last_epoch,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            decay=self.decay,
            min_lr_ratio=self.min_lr_ratio,
        )
        return [group["initial_lr"] * factor for group in self.optimizer.param_groups]
