"""`DeltaL1`: an L1 penalty on the fine-tuning delta ``theta - theta_base`` (PAFT's SFT arm).

PAFT (Pentyala et al. 2024) regularises the SFT run with ``strength x ||theta - theta_base||_1`` so
its delta becomes sparse and merges with the (naturally sparse) DPO delta with less interference.
Here the penalty is applied as its proximal step after every optimizer step, decoupled from the
optimizer the way AdamW decouples weight decay: each entry of the delta is soft-thresholded,

    delta <- sign(delta) x max(|delta| - lr x strength, 0),

which is the exact minimiser of the penalty's step (proximal gradient; Beck & Teboulle 2009) and,
unlike adding ``strength x sign(delta)`` to Adam's gradient (rescaled by 1/sqrt(v)), drives
entries to exactly 0. ``trainer/merge.py`` reports the resulting sparsity.

The base is the model at step 0 (after ``model.init_from``), kept as a copy of each parameter
sharded like it (a DTensor under FSDP/TP: the thresholding is elementwise, no communication).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override


def soft_threshold_(param: torch.Tensor, base: torch.Tensor, threshold: float) -> None:
    """In place: ``param = base + sign(d) x max(|d| - threshold, 0)`` with ``d = param - base``."""
    delta = param - base
    param.copy_(base + torch.sign(delta) * torch.clamp(delta.abs() - threshold, min=0.0))


class DeltaL1(L.Callback):
    """Proximal L1 pull of every trainable parameter toward its value at step 0.

    Args:
        strength: the penalty's weight (per unit of summed |delta|); 0 turns it off.

    Raises:
        RuntimeError: a resumed run (the step-0 base is not in the checkpoint): start the arm
            again from the base with ``model.init_from``.
    """

    def __init__(self, strength: float = 1e-4) -> None:
        if strength < 0:
            raise ValueError(f"callbacks.delta_l1.strength={strength} must be >= 0")
        self.strength = strength
        self._base: dict[str, torch.Tensor] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_step > 0:
            raise RuntimeError(
                "callbacks.delta_l1 keeps the base weights of step 0, which a resumed run does not have; "
                "restart the run from its base (model.init_from=...) without resume, or drop callbacks.delta_l1"
            )
        self._base = {n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad}

    @override
    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.strength:
            return
        names = {id(p): n for n, p in pl_module.model.named_parameters()}
        for group in trainer.optimizers[0].param_groups:
            # The scheduler has already stepped: this is the next step's lr (equal under a constant schedule).
            threshold = group["lr"] * self.strength
            for p in group["params"]:
                name = names.get(id(p))
                if name in self._base:
                    soft_threshold_(p, self._base[name], threshold)
