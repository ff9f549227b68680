"""``summary.json``: the headline figures of a run, for scripts (printed at the end of ``plait``).

One JSON object, written by rank 0 when training ends, also when a non-finite run, a stop signal
or Ctrl-C ends it. Its keys, in groups (a later group adds keys; none is renamed):

- the run's figures (`headline`): ``steps`` (optimizer steps done), ``first_val_loss``,
  ``final_val_loss``, ``final_train_loss``, ``tokens_seen``, ``wall_time_s``, ``tokens_per_s``
  (and with local SGD ``comm_bytes_sent_per_rank`` / ``comm_bytes_sent_per_step``);
- its length (`stop_fields`): ``max_steps`` (``trainer.max_steps``), ``planned_steps`` (fewer when
  the data ends first, `trainer.run_length`), ``stopped_by`` (``max_steps``, ``data_exhausted``,
  ``nonfinite``, ``signal``, ``callback``, ``interrupted``) and ``stop_reason`` (null for
  ``max_steps``, else the sentence saying why and what to change);
- whether it learns (`val_measures`): ``first_val_metrics`` and ``final_val_metrics``, the first
  and the last evaluation's headline metrics by their metrics.csv names: what the objective and the
  evaluators declare (`trainer.protocols.Objective.headline_metrics`, e.g.
  ``{"val/rewards/accuracy": 0.97, "val/rewards/margin": 4.2}`` for DPO,
  ``{"val/exact_match/addition": 0.81}`` where an evaluator scores exact match; ``{}`` for none);
- the steps whose update was skipped (`skipped_steps`): ``skipped_steps`` (non-finite or spiking,
  `trainer.nonfinite`), ``spike_steps`` (of which spikes) and ``rollbacks``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from trainer.callbacks.preemption import Stopped
from trainer.data import accounting
from trainer.nonfinite import NonFiniteError, NonFiniteGuard
from trainer.off_step import OffStepClock
from trainer.run_length import CALLBACK, DATA_EXHAUSTED, INTERRUPTED, MAX_STEPS, NONFINITE, SIGNAL, RunLength
from trainer.rundir import RunDir


def headline(
    history: list[dict[str, float]],
    *,
    tokens_seen: int,
    wall_time_s: float,
    steps: int,
    warm: tuple[int, float] = (0, 0.0),
) -> dict[str, Any]:
    """First and final validation loss, tokens seen, wall time and tokens/s of a run's history, and
    with local SGD the bytes each rank sent to other islands (total and per step).

    ``warm`` is (tokens, seconds) after each process's first optimizer step, less the evaluations,
    checkpoint saves and exports between steps (`trainer.off_step`): ``tokens_per_s`` is their
    ratio, a training speed, so start-up, compilation and the first step's warm-up do not count (a 2-step run
    read 114 tokens/s against 2059 for the same job warm). A run of one step per process has no
    warm part and falls back to ``tokens_seen / wall_time_s``."""
    val = [h["val_loss"] for h in history if h.get("val_loss") is not None]
    train = [h["loss"] for h in history if "loss" in h]
    comm = [h["comm/bytes_sent_total"] for h in history if "comm/bytes_sent_total" in h]
    extra = {"comm_bytes_sent_per_rank": comm[-1], "comm_bytes_sent_per_step": comm[-1] / steps} if comm else {}
    return {
        "steps": steps,
        "first_val_loss": val[0] if val else None,
        "final_val_loss": val[-1] if val else None,
        "final_train_loss": train[-1] if train else None,
        "tokens_seen": tokens_seen,
        "wall_time_s": round(wall_time_s, 3),
        "tokens_per_s": round(warm[0] / warm[1], 1)
        if warm[1] > 0
        else round(tokens_seen / wall_time_s, 1)
        if wall_time_s > 0
        else None,
        **extra,
    }


def stop_fields(length: RunLength, stopped_by: str, reason: str | None) -> dict[str, Any]:
    """``max_steps``, ``planned_steps`` (`trainer.run_length.RunLength`), ``stopped_by`` (one of
    the causes of `trainer.run_length`) and ``stop_reason`` (None when ``max_steps`` ended it)."""
    return {
        "max_steps": length.max_steps,
        "planned_steps": length.planned_steps,
        "stopped_by": stopped_by,
        "stop_reason": reason,
    }


def val_measures(history: list[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """``first_val_metrics`` and ``final_val_metrics``: the ``names`` of the first and the last
    evaluation of ``history`` (`trainer.task.Task.history`) that recorded any of them."""
    scored = [
        {n: h["metrics"][n] for n in names if n in h["metrics"]} for h in history if "val_loss" in h and "metrics" in h
    ]
    scored = [metrics for metrics in scored if metrics]
    return {"first_val_metrics": scored[0] if scored else {}, "final_val_metrics": scored[-1] if scored else {}}


def ended_by(trainer: L.Trainer, pl_module: Any) -> tuple[str, str | None]:
    """``(stopped_by, stop_reason)`` of a run whose training loop ended without an exception: its
    ``max_steps``, the end of its data, or a callback that set ``trainer.should_stop`` (its
    ``stop_reason`` attribute says why, e.g. mSFT's patience)."""
    if trainer.global_step >= trainer.max_steps:
        return MAX_STEPS, None
    if pl_module.data_ended():  # planned at launch, or found when it happens (a stream's length is unknown ahead)
        end_reason = getattr(trainer.datamodule, "end_reason", None)
        late = (
            end_reason(trainer.global_step)
            if end_reason
            else f"the training data ended after step {trainer.global_step}"
        )
        return DATA_EXHAUSTED, pl_module.run_length().reason or late
    reasons = [r for c in trainer.callbacks if (r := getattr(c, "stop_reason", None))]
    return CALLBACK, reasons[0] if reasons else f"a callback set trainer.should_stop after step {trainer.global_step}"


def interrupted_by(exception: BaseException, step: int) -> tuple[str, str] | None:
    """``(stopped_by, stop_reason)`` of an exception that ends a run on purpose; None for a crash."""
    if isinstance(exception, NonFiniteError):
        return NONFINITE, str(exception)
    if isinstance(exception, Stopped):
        name = signal.Signals(exception.signum).name if exception.signum else "a stop signal"
        return SIGNAL, f"{name} received: stopped after step {step}; continue with resume=last"
    if isinstance(exception, KeyboardInterrupt):
        return INTERRUPTED, f"interrupted (Ctrl-C) after step {step}"
    return None


def skipped_steps(guard: NonFiniteGuard) -> dict[str, int]:
    """``skipped_steps``: the steps whose update was skipped (`trainer.nonfinite`: non-finite or
    a spike), ``spike_steps``: of which spikes, ``rollbacks``: checkpoints reloaded
    (``train.nonfinite=rollback``)."""
    return {"skipped_steps": guard.skipped, "spike_steps": guard.spiked, "rollbacks": guard.rollbacks}


class Summary(L.Callback):
    """Writes ``<dirpath>/summary.json`` (module docstring) at the end of training, or when a run
    is stopped on purpose (rank 0); wall time and the warm tokens/s (see `headline`) survive resumes.

    Args:
        dirpath: the run directory (the trainer sets it).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = Path(dirpath) if dirpath else None
        self.wall_time_s = 0.0
        self._since = 0.0
        self.warm_tokens, self.warm_s = 0, 0.0  # before this process
        # (tokens_seen, time, off-step seconds) after this process's first step
        self._warm_from: tuple[int, float, float] | None = None
        self._off_step: OffStepClock | None = None  # the Task's: evaluations, saves, exports
        self._tokens_now = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._since = time.perf_counter()
        self._warm_from = None
        self._off_step = pl_module.off_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._tokens_now = pl_module.tokens_seen
        if self._warm_from is None:
            self._warm_from = (pl_module.tokens_seen, time.perf_counter(), self._off_seconds())

    def _elapsed(self) -> float:
        return self.wall_time_s + (time.perf_counter() - self._since)

    def _off_seconds(self) -> float:
        return self._off_step.seconds if self._off_step is not None else 0.0

    def _warm(self, tokens_seen: int) -> tuple[int, float]:
        """(tokens, training seconds) after each process's first step: the wall time less the
        evaluations, saves and exports between steps (`trainer.off_step`)."""
        if self._warm_from is None:
            return self.warm_tokens, self.warm_s
        tokens, since, off = self._warm_from
        seconds = time.perf_counter() - since - (self._off_seconds() - off)
        return self.warm_tokens + tokens_seen - tokens, self.warm_s + seconds

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, pl_module, *ended_by(trainer, pl_module))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A run stopped on purpose still has its figures; a crash has none (its traceback says why).
        # Lightning calls this hook in the process that called fit: under a fork launcher (tests,
        # mSFT's roll-outs) that is the parent, which trained nothing (on_train_start never ran here).
        stop = interrupted_by(exception, trainer.global_step)
        if stop is not None and self._since:
            # The guard's stop: the step it names (a host-side verdict stops before Lightning counts it).
            steps = exception.step if isinstance(exception, NonFiniteError) else None
            self._write(trainer, pl_module, *stop, steps=steps)

    def _write(
        self, trainer: L.Trainer, pl_module: Any, stopped_by: str, reason: str | None, steps: int | None = None
    ) -> None:
        if not trainer.is_global_zero or self.dirpath is None:
            return
        summary = {
            **headline(
                pl_module.history,
                tokens_seen=pl_module.tokens_seen,
                wall_time_s=self._elapsed(),
                steps=trainer.global_step if steps is None else steps,
                warm=self._warm(pl_module.tokens_seen),
            ),
            **stop_fields(pl_module.run_length(), stopped_by, reason),
            **val_measures(pl_module.history, pl_module.headline_metrics()),
            **skipped_steps(pl_module.nonfinite),
        }
        if trainer.datamodule is not None and (counts := trainer.datamodule.data_counts()):
            # per source: samples dropped, truncated, tokens lost (training split, and "held_out")
            summary["data"] = accounting.as_json(counts, trainer.datamodule.held_out_counts())
        path = RunDir(self.dirpath).summary
        path.parent.mkdir(parents=True, exist_ok=True)  # a run without loggers may have written nothing yet
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)

    @override
    def state_dict(self) -> dict[str, Any]:
        warm_tokens, warm_s = self._warm(self._tokens_now)
        return {
            "wall_time_s": self._elapsed() if self._since else self.wall_time_s,
            "warm_tokens": warm_tokens,
            "warm_s": warm_s,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wall_time_s = state_dict["wall_time_s"]
        self.warm_tokens, self.warm_s = (
            state_dict.get("warm_tokens", 0),
            state_dict.get("warm_s", 0.0),
        )  # older runs: none
