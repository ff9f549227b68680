"""Anomalous steps: a NaN or inf loss or gradient norm, or a spike, skips the step's update.

A step is anomalous when its loss or global gradient norm is not finite, or when it spikes
against the recent admitted steps (`trainer.spikes`, ``train.spike_factor``; 0 turns that rule
off). The verdict is reached *before* the optimizer step, so an anomalous step's update is never
applied. With a fused optimizer (plait's default AdamW) the verdict stays on the device: it sets
the optimizer's ``found_inf`` flag, and its kernel skips the update (`NonFiniteGuard.skip_on_device`);
`NonFiniteGuard.admit` counts the step when the Task next reads its values. Other optimizers read
the values and the verdict to the host before each optimizer step, and `admit` decides there. A
skipped step still counts as a step (the data is consumed, the LR schedule advances), but its
gradients are dropped (``set_to_none``): every torch optimizer leaves parameters without a gradient
untouched, moments and step counts included, so the parameters and the optimizer state stay what
they were. Checkpoints refuse non-finite state on their own (`strategies.checkpoint.dcp.save`).

A step's loss and gradient norm are computed on the weights the previous update made, so the
first anomalous step ``k`` also accuses the weights of step ``k - 1``: the newest checkpoint of a
step ``<= k - 2`` (`NonFiniteGuard.safe_step`) is the one to continue from. The checkpoint callback
keeps it from pruning until the run has recovered (``recover_after`` admitted steps in a row), the
stop message names it, and ``train.nonfinite=rollback`` reloads it (`trainer.rollback.roll_back`).

Skipping non-finite updates and counting them follows Megatron-LM's skipped iterations (its
loss-scaler's ``found_inf`` skips the update); stopping after a run of them, the spike rule's
collapse test and the limit on skipped steps are plait's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.rundir import step_checkpoints
from trainer.spikes import SpikeRule

# A step's verdict, a float on the device until the Task reads it.
ADMITTED, NONFINITE, SPIKE = 0.0, 1.0, 2.0


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite steps; the message says which and what to change.

    Attributes:
        step: the optimizer step (1 for the first) that stopped it.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class NonFiniteGuard:
    """Decides per optimizer step whether its update is applied (module docstring).

    Args:
        policy: "stop": skip an anomalous step's update, and stop the run when ``max_consecutive``
            steps in a row were anomalous; "rollback": there, reload the checkpoint from before the
            first of them (`safe_checkpoint`; the Task does it, `rollback_due`) and go on with the
            data after them, at most ``max_rollbacks`` times, then stop; "skip": skip each such
            update and go on, until more than ``max_skipped`` steps of the run were skipped.
        max_consecutive: anomalous steps in a row that stop the run under "stop" (1: the first).
        max_skipped: skipped steps of the whole run that "skip" tolerates; the next one stops it.
        max_rollbacks: rollbacks of the whole run that "rollback" makes before it stops.
        spikes: the spike rule (`trainer.spikes.SpikeRule`); None: only non-finite steps are anomalous.
        recover_after: admitted steps in a row after which the run has recovered from an anomaly
            (the checkpoint before it may then be pruned).

    Raises:
        ValueError: an unknown policy, or a count below 1.
    """

    def __init__(
        self,
        policy: Literal["stop", "skip", "rollback"] = "stop",
        max_consecutive: int = 3,
        max_skipped: int = 10,
        spikes: SpikeRule | None = None,
        recover_after: int = 20,
        max_rollbacks: int = 2,
    ) -> None:
        if policy not in ("stop", "skip", "rollback"):
            raise ValueError(f"train.nonfinite={policy!r}: use stop, skip or rollback")
        if max_consecutive < 1:
            raise ValueError(f"train.max_nonfinite_steps={max_consecutive}: use 1 or more")
        if max_skipped < 0 or recover_after < 1:
            raise ValueError(
                f"train.max_skipped_steps={max_skipped} must be >= 0 and recover_after={recover_after} >= 1"
            )
        self.policy, self.max_consecutive, self.max_skipped = policy, max_consecutive, max_skipped
        self.spikes, self.recover_after, self.max_rollbacks = spikes, recover_after, max_rollbacks
        self.rollbacks = 0  # checkpoints reloaded by "rollback"
        self.rollback_due: Path | None = None  # the checkpoint the Task reloads at the end of this step
        self.consecutive = 0  # anomalous steps in a row, up to the current one
        self.skipped = 0  # anomalous steps of the whole run
        self.spiked = 0  # of which spikes (finite values)
        self.first: dict[str, float] | None = None  # the first anomalous step of the open episode
        self.healthy = 0  # admitted steps in a row since the last anomalous one

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

    def verdict(self, values: torch.Tensor, *, judged: torch.Tensor, islands: Any = None) -> torch.Tensor:
        """0-dim float32 on the device: ``ADMITTED``, ``NONFINITE`` or ``SPIKE`` for ``values``
        (`combine`); an admitted step joins the spike rule's history. No host read.

        Args:
            judged: 0-dim bool, false for a step without supervised tokens (never a spike).
            islands: as in `combine`: a spike on one island makes every island skip the step.
        """
        finite = torch.isfinite(values).all()
        if self.spikes is None:
            return torch.where(finite, ADMITTED, NONFINITE)
        spike = finite & self.spikes.spikes(values, judged)
        if islands is not None:
            spike = islands(spike.float().reshape(1)).reshape(()) > 0
        self.spikes.observe(values, finite & ~spike)
        return torch.where(finite, torch.where(spike, SPIKE, ADMITTED), NONFINITE)

    def skip_on_device(self, optimizer: torch.optim.Optimizer, verdict: torch.Tensor) -> bool:
        """Makes ``optimizer`` skip this step's update on the device when ``verdict`` is not
        ``ADMITTED``, with no host read; False (nothing set) if it cannot.

        A fused torch optimizer (``fused=True``: Adam, AdamW, SGD, Adagrad; the ones whose
        ``_step_supports_amp_scaling`` is set) takes a ``found_inf`` flag, as from a gradient
        scaler: at 1 its kernel leaves parameters, moments and step counts as they were, which is
        exactly what a skipped step does. The steps are then counted (and a run of them stops
        the run) when the Task reads its values (`admit`, in step order). Other optimizers need
        the host read before the step.
        """
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        optimizer.found_inf = (verdict != ADMITTED).float()
        return True

    def safe_step(self) -> int | None:
        """While an anomaly is unresolved: the newest step whose weights precede it (checkpoints
        of that step or older are safe to continue from); None when the run is healthy."""
        return None if self.first is None else max(int(self.first["step"]) - 2, 0)

    def admit(
        self, step: int, loss: float, grad_norm: float, verdict: float, *, checkpoints: Path | None = None
    ) -> bool:
        """Whether optimizer step ``step`` (1 for the first) applies its update.

        Args:
            checkpoints: the run's ``checkpoints/`` directory, for the stop message's advice.

        Raises:
            NonFiniteError: under "stop", the ``max_consecutive``-th anomalous step in a row; under
                "skip", the step that makes more than ``max_skipped`` skipped steps.
        """
        if verdict == ADMITTED:
            self.consecutive = 0
            self.healthy += 1
            if self.healthy >= self.recover_after:
                self.first = None  # recovered: the checkpoint before the anomaly may go
            return True
        self.consecutive += 1
        self.skipped += 1
        self.spiked += int(verdict == SPIKE)
        self.healthy = 0
        if self.first is None:
            self.first = {"step": step, "loss": loss, "grad_norm": grad_norm, "verdict": verdict}
        if self.policy in ("stop", "rollback") and self.consecutive >= self.max_consecutive:
            safe = self.safe_checkpoint(checkpoints)
            if self.policy == "rollback" and self.rollbacks < self.max_rollbacks and safe is not None:
                self.rollback_due = safe
                return False
            rolled = f", after {self.rollbacks} rollback(s) (train.max_rollbacks={self.max_rollbacks})"
            raise NonFiniteError(
                f"training stopped at step {step}: {self.consecutive} anomalous step(s) in a row, {self.skipped} in all "
                f"({self.counts()}); the first, step {self.first['step']}, had {_describe(self.first, self.spikes)} "
                f"(train.nonfinite={self.policy}{rolled if self.policy == 'rollback' else ''}, "
                f"train.max_nonfinite_steps={self.max_consecutive}). Their updates were skipped. {self.advice(checkpoints)}"
                f"; or skip such steps and go on with train.nonfinite=skip",
                step=step,
            )
        if self.policy == "skip" and self.skipped > self.max_skipped:
            raise NonFiniteError(
                f"training stopped at step {step}: {self.skipped} steps skipped ({self.counts()}), more than "
                f"train.max_skipped_steps={self.max_skipped} (train.nonfinite=skip); the first anomaly was at step "
                f"{self.first['step']} ({_describe(self.first, self.spikes)}). {self.advice(checkpoints)}",
                step=step,
            )
        return False

    def counts(self) -> str:
        """The skipped steps by cause: '1 non-finite, 2 spike(s)'."""
        return f"{self.skipped - self.spiked} non-finite, {self.spiked} spike(s)"

    def safe_checkpoint(self, checkpoints: Path | None) -> Path | None:
        """The newest complete checkpoint in ``checkpoints`` of a step ``<=`` `safe_step`; None
        without an unresolved anomaly or such a checkpoint."""
        safe = self.safe_step()
        if safe is None or checkpoints is None:
            return None
        found = [p for p in step_checkpoints(checkpoints) if int(p.name[5:]) <= safe]
        return found[-1] if found else None

    def rolled_back(self) -> None:
        """The Task reloaded `rollback_due`: the run goes on from there (the anomaly stays open, so
        the checkpoint stays protected until the run recovers)."""
        self.rollbacks += 1
        self.consecutive, self.rollback_due = 0, None

    def advice(self, checkpoints: Path | None) -> str:
        """What to run next: continue from the newest checkpoint before the anomaly (`safe_step`)
        with a lower optim.lr, or start again when none precedes it."""
        first = int(self.first["step"]) if self.first is not None else 1
        found = self.safe_checkpoint(checkpoints)
        cause = f"Step {first}'s values were computed on the weights of step {first - 1}, which are suspect too"
        if found is None:
            return (
                f"{cause}, and no checkpoint precedes them: start a new run with a lower optim.lr (the same seed gives "
                f"the same initial weights)"
            )
        run_dir = checkpoints.parent if checkpoints is not None else None
        return (
            f"{cause}: continue from {found.name}, the newest checkpoint before them, with a lower optim.lr: "
            f"run_dir={run_dir} resume={found} resume_override=[optim.lr] optim.lr=<lower>"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive": self.consecutive, "skipped": self.skipped, "spiked": self.spiked, "first": self.first,
            "healthy": self.healthy, "rollbacks": self.rollbacks,
            "spikes": self.spikes.state_dict() if self.spikes is not None else None,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive, self.skipped = int(state["consecutive"]), int(state["skipped"])
        # Checkpoints from before the spike rule hold only the two counts above.
        self.spiked, self.first, self.healthy = (
            int(state.get("spiked", 0)),
            state.get("first"),
            int(state.get("healthy", 0)),
        )
        self.rollbacks = int(state.get("rollbacks", 0))
        if self.spikes is not None and state.get("spikes") is not None:
            self.spikes.load_state_dict(state["spikes"])


def _describe(first: dict[str, float], spikes: SpikeRule | None) -> str:
    """The values of an anomalous step and why they were refused."""
    values = f"loss={first['loss']:.6g}, grad_norm={first['grad_norm']:.6g}"
    if first["verdict"] == SPIKE and spikes is not None:
        return f"{values}, a spike against the last admitted steps (train.spike_factor={spikes.factor:g})"
    return f"{values}, not finite"
