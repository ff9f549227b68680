"""Non-finite steps: a NaN or inf loss or gradient norm skips the step's update, and stops the run.

With a fused optimizer (plait's default AdamW) the decision stays on the device: a non-finite
step sets the optimizer's ``found_inf`` flag, and its kernel skips the update
(`NonFiniteGuard.skip_on_device`); `NonFiniteGuard.admit` counts the step when the Task next reads
its values. Other optimizers read the loss and global gradient norm to the host before each
optimizer step, and `admit` decides there whether the update is applied. A skipped step still counts as a step (the data
is consumed, the LR schedule advances), but its gradients are dropped (``set_to_none``): every
torch optimizer leaves parameters without a gradient untouched, moments and step counts included,
so the parameters and the optimizer state stay what they were. Checkpoints refuse non-finite
state on their own (`strategies.checkpoint.save`), so a run that diverged keeps its last finite
checkpoints.

Skipping non-finite updates and counting them follows Megatron-LM's skipped iterations (its
loss-scaler's ``found_inf`` skips the update); stopping after a run of them is plait's.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite steps; the message says which and what to change."""


class NonFiniteGuard:
    """Decides per optimizer step whether its update is applied.

    Args:
        policy: "stop": skip a non-finite step's update and stop the run when ``max_consecutive``
            steps in a row were non-finite; "skip": skip each such update and go on.
        max_consecutive: non-finite steps in a row that stop the run under "stop" (1: the first).

    Raises:
        ValueError: an unknown policy or ``max_consecutive < 1``.
    """

    def __init__(self, policy: Literal["stop", "skip"] = "stop", max_consecutive: int = 3) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"train.nonfinite={policy!r}: use stop or skip")
        if max_consecutive < 1:
            raise ValueError(f"train.max_nonfinite_steps={max_consecutive}: use 1 or more")
        self.policy, self.max_consecutive = policy, max_consecutive
        self.consecutive = 0  # non-finite steps in a row, up to the current one
        self.skipped = 0  # non-finite steps of the whole run

    def combine(self, loss: torch.Tensor, grad_norm: torch.Tensor, *, islands: Any = None) -> torch.Tensor:
        """[2] float32 (loss, gradient norm) on the device, without reading them.

        Args:
            loss, grad_norm: 0-dim tensors, equal on every rank.
            islands: under local SGD, a function that sums a tensor over the islands (whose
                gradient norms differ): a non-finite gradient on one island makes every island
                see NaN, so all of them skip the step together. None otherwise.
        """
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())])
        if islands is not None:
            bad = islands((~torch.isfinite(values)).any().float().reshape(1))
            values = torch.where(bad > 0, torch.full_like(values, math.nan), values)
        return values

    def skip_on_device(self, optimizer: torch.optim.Optimizer, values: torch.Tensor) -> bool:
        """Makes ``optimizer`` skip this step's update on the device when ``values`` (`combine`)
        are not finite, with no host read; False (nothing set) if it cannot.

        A fused torch optimizer (``fused=True``: Adam, AdamW, SGD, Adagrad; the ones whose
        ``_step_supports_amp_scaling`` is set) takes a ``found_inf`` flag, as from a gradient
        scaler: at 1 its kernel leaves parameters, moments and step counts as they were, which is
        exactly what a skipped step does. The steps are then counted (and a run of them stops
        the run) when the Task reads its values (`admit`, in step order). Other optimizers need
        the host read before the step (`read`).
        """
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        optimizer.found_inf = (~torch.isfinite(values)).any().float()
        return True

    def read(self, loss: torch.Tensor, grad_norm: torch.Tensor, *, islands: Any = None) -> tuple[float, float]:
        """(loss, gradient norm) on the host (`combine`, then one device-to-host transfer)."""
        loss_value, grad_norm_value = self.combine(loss, grad_norm, islands=islands).tolist()
        return loss_value, grad_norm_value

    def admit(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether optimizer step ``step`` (1 for the first) applies its update.

        Raises:
            NonFiniteError: under "stop", the ``max_consecutive``-th non-finite step in a row.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        if self.policy == "stop" and self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"training stopped at step {step}: loss={loss}, grad_norm={grad_norm}, non-finite for "
                f"{self.consecutive} step(s) in a row (train.nonfinite=stop, train.max_nonfinite_steps="
                f"{self.max_consecutive}); their updates were skipped and no checkpoint holds NaN or inf. "
                f"Lower optim.lr or set train.max_grad_norm, then continue from the last finite checkpoint with "
                f"resume=last; or skip such steps and go on with train.nonfinite=skip"
            )
        return False

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive, self.skipped = int(state["consecutive"]), int(state["skipped"])
