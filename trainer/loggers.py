"""A CSV logger that survives resumes: ``<run_dir>/metrics.csv`` is appended to, never deleted.

Lightning's CSVLogger deletes an existing metrics.csv when its directory is not empty, which
would wipe a run's history on ``resume=last``.
"""

from __future__ import annotations

import csv

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from trainer.rundir import RunDir


class _AppendingWriter(ExperimentWriter):
    NAME_METRICS_FILE = RunDir(".").metrics.name

    @override
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])


class RunCSVLogger(CSVLogger):
    """Writes ``metrics.csv`` (and ``hparams.yaml``) directly into ``save_dir``.

    Args:
        save_dir: the run directory (the trainer sets it).
    """

    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir, name="", version="")

    @property
    @override
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether the current optimizer step writes a row to the loggers.

    Every ``trainer.log_every_n_steps`` optimizer steps, and the last step of the run. For hooks
    that run after the optimizer step, when ``trainer.global_step`` already counts it.
    """
    step, every = trainer.global_step, trainer.log_every_n_steps
    return (every > 0 and step % every == 0) or step == trainer.max_steps
