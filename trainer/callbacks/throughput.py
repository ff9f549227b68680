"""Tokens per second, TFLOP/s and MFU of the training steps.

MFU = achieved model FLOP/s / peak FLOP/s (Chowdhery et al. 2022, PaLM, appendix B), with the
model's ``flops_per_token`` (6N + attention) and a configured per-device peak: CPUs and many
accelerators have no queryable peak, so it is a setting, not a guess.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Annotated, Any

import lightning as L
from typing_extensions import override

from strategies.core.ranges import POSITIVE
from trainer.loggers import is_logging_step


class Throughput(L.Callback):
    """Logs ``perf/tokens_per_s`` (also on the progress bar), ``perf/tflops`` and ``perf/mfu``
    over the last ``window`` steps, on the steps Lightning writes to the loggers.

    The Task reads a step's values to the host only on logging and evaluation steps
    (`trainer.step_metrics`), so on an accelerator a step's measured time is its host time and
    a logging step's also includes the queued work of the steps before it: a window that spans
    whole logging intervals (``window`` a multiple of ``trainer.log_every_n_steps``, as in the
    defaults, 10 and 10) measures the true time. On a CPU every step's time is its own.

    Args:
        window: steps in the moving window.
        peak_tflops: peak dense TFLOP/s of one device in the run's precision (e.g. 989 for an
            H100 SXM in bf16); None: MFU is not reported.
    """

    def __init__(
        self, window: Annotated[int, POSITIVE] = 10, peak_tflops: Annotated[float, POSITIVE] | None = None
    ) -> None:
        if window < 1:
            raise ValueError("callbacks.throughput.window must be >= 1")
        self.window, self.peak_tflops = window, peak_tflops
        self._times: deque[float] = deque(maxlen=window)
        self._tokens: deque[int] = deque(maxlen=window)
        self._start = 0.0
        self.train_seconds = 0.0  # summed over steps (evaluation and checkpoints excluded)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        elapsed = time.perf_counter() - self._start
        self.train_seconds += elapsed
        self._times.append(elapsed)
        self._tokens.append(pl_module.last_step_tokens)
        if not (is_logging_step(trainer) or pl_module.data_ended()):  # the last step of data that ended too
            return  # a windowed figure: logging it on logging steps only saves ~1 ms per key per step
        tokens_per_s = sum(self._tokens) / max(sum(self._times), 1e-9)
        pl_module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True, logger=False)
        tflops = tokens_per_s * pl_module.flops_per_token / 1e12
        metrics = {"perf/tokens_per_s": tokens_per_s, "perf/tflops": tflops}
        if self.peak_tflops:
            metrics["perf/mfu"] = tflops / (self.peak_tflops * trainer.world_size)
        pl_module.record(metrics)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"train_seconds": self.train_seconds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_seconds = state_dict["train_seconds"]
