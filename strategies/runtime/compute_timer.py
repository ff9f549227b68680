"""Per-rank compute time of a step's forward/backward, without the gradient synchronisation.

Ranks that synchronise inside a step wait for the slowest one, so whole-step times converge and
hide the imbalance (`trainer.callbacks.balance`). This timer adds up, per rank, the seconds of
each micro-batch's forward and backward while its gradient sync is off (every micro-batch but the
last, under gradient accumulation) and of the last micro-batch's forward: the time to the step's
first gradient-sync collective. The last backward (where the gradient reduction runs and waits)
is left out, so the figure is a lower bound of the compute; forward collectives (FSDP gathers
with dp_shard > 1, the cp ring) stay inside it. On CUDA the device is synchronised at each mark.

Off unless ``enabled`` (the telemetry callback switches it on): then ``seconds`` is the last step's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ComputeTimer:
    """Seconds of forward/backward before a step's gradient sync (module docstring)."""

    def __init__(self) -> None:
        self.enabled, self.seconds = False, 0.0

    def start_step(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        """Adds the seconds spent inside to ``seconds`` (when ``enabled``)."""
        if not self.enabled:
            yield
            return
        _synchronize(device)
        start = time.perf_counter()
        yield
        _synchronize(device)
        self.seconds += time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
