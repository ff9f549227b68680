"""How many optimizer steps a run plans to train, and what ends it, known before the first step.

A run trains ``trainer.max_steps`` optimizer steps unless its data ends first: an SFT mixture ends
when every source has spent its budget (``max_epochs`` passes over its samples, 1.0 unless set, or
``max_tokens`` supervised tokens; `trainer.protocols.DataModule.finite_steps`). The data module
says which budgets end it and which settings lengthen the run (`DataModule.end_reason`). The
launch prints one line when the data ends the run before ``max_steps``::

    plait: the run ends after 5 of trainer.max_steps=20 steps: data.sources.mine is spent after
    max_epochs=1.0 (5 steps); raise +data.sources.mine.max_epochs

the LR schedule spans the planned steps (`trainer.task.Task.total_steps`), and ``summary.json``
records both with what did stop the run (`trainer.callbacks.summary`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What can end a run (``summary.json``'s ``stopped_by``): the first two are planned at launch, the
# others happen during training (trainer.nonfinite, trainer.callbacks.preemption, a callback that
# sets ``trainer.should_stop`` such as mSFT's patience, Ctrl-C).
MAX_STEPS, DATA_EXHAUSTED = "max_steps", "data_exhausted"
NONFINITE, SIGNAL, CALLBACK, INTERRUPTED = "nonfinite", "signal", "callback", "interrupted"


@dataclass(frozen=True)
class RunLength:
    """The planned length of a run.

    Attributes:
        max_steps: ``trainer.max_steps``.
        planned_steps: optimizer steps the run will train, ``<= max_steps``.
        ends_by: `MAX_STEPS` or `DATA_EXHAUSTED` (the data ends before ``max_steps``).
        reason: with `DATA_EXHAUSTED`, what ends the data and the setting that lengthens it.
    """

    max_steps: int
    planned_steps: int
    ends_by: str = MAX_STEPS
    reason: str | None = None

    def launch_line(self) -> str | None:
        """The line the launch prints (after ``plait: ``) when the run ends before ``max_steps``."""
        if self.planned_steps >= self.max_steps:
            return None
        return f"the run ends after {self.planned_steps} of trainer.max_steps={self.max_steps} steps: {self.reason}"


def plan_run_length(max_steps: int, data: Any | None) -> RunLength:
    """The run's planned length under ``trainer.max_steps`` and its data module.

    Args:
        max_steps: ``trainer.max_steps`` (positive).
        data: a `trainer.protocols.DataModule`, or None (a Task fitted without one: ``max_steps``).
            One without ``end_reason`` (a user's own) gets a generic reason.
    """
    finite = data.finite_steps() if data is not None else None
    if finite is None or finite >= max_steps:
        return RunLength(max_steps, max_steps)
    end_reason = getattr(data, "end_reason", None)
    reason = end_reason(finite) if end_reason is not None else f"the training data ends after {finite} steps"
    return RunLength(max_steps, finite, DATA_EXHAUSTED, reason)
