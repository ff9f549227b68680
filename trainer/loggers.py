"""A CSV logger that survives resumes and kills: ``<run_dir>/metrics.csv`` is appended to, never deleted.

Lightning's CSVLogger deletes an existing metrics.csv when its directory is not empty, which
would wipe a run's history on ``resume=last``, and rewrites the file in place when a new column
appears, which a kill at that moment would leave truncated. Here a rewrite goes through a
temporary file and an atomic rename. A resumed run drops the rows after the step it resumed
from when it starts (`RunCSVLogger.drop_after`: a killed run's rows after its last checkpoint, or
the course a run left by resuming from an older checkpoint), and any run drops the existing rows of
its first row's step and later when it writes it (a fresh start into a killed run's directory
drops all of them). A resumed run's file then equals an uninterrupted run's.

A power cut can leave the file's tail as NUL bytes or a partial row (the size was written, the
data was not): `repair_metrics` drops such lines when the writer opens the file, and says so.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from trainer.rundir import RunDir


class _AppendingWriter(ExperimentWriter):
    NAME_METRICS_FILE = RunDir(".").metrics.name

    @override
    def _check_log_dir_exists(self) -> None:
        self._continues = False  # set by the first row of this process
        if (line := repair_metrics(self.metrics_file_path)) is not None:
            print(f"plait: {line}", file=sys.stderr, flush=True)
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    @override
    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        if not self._continues and step is not None:
            drop_rows_from(self.metrics_file_path, step)
        self._continues = True
        super().log_metrics(metrics_dict, step)

    @override
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
        _replace(self.metrics_file_path, text.getvalue())


def _replace(path: str, text: str | bytes) -> None:
    """Writes ``text`` to ``path`` through a temporary file and an atomic rename (fsynced)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", newline="") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def _row_step(line: bytes, num_fields: int, column: int) -> int | None:
    """The step of one complete, well-formed row (``\n``-terminated, UTF-8, no NUL, every field),
    or None."""
    if not line.endswith(b"\n") or b"\0" in line:
        return None
    try:
        fields = next(csv.reader([line.decode("utf-8")]))
        return int(float(fields[column])) if len(fields) == num_fields else None
    except (UnicodeDecodeError, ValueError, StopIteration):
        return None


def repair_metrics(path: str) -> str | None:
    """Drops the damaged lines of the metrics file ``path``: NUL bytes, a partial row, anything
    that is not a complete row of the header's fields (what a power cut or a full disk leaves at
    its end). The rows kept are unchanged byte for byte. A damaged header moves the whole file
    to ``<path>.damaged`` (a new file is started).

    Returns:
        one line that says what was dropped, or None when the file is intact or absent.
    """
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as file:
        lines = file.read().splitlines(keepends=True)
    header = lines[0] if lines else b""
    try:
        names = next(csv.reader([header.decode("utf-8")])) if header.endswith(b"\n") and b"\0" not in header else []
    except (UnicodeDecodeError, StopIteration):
        names = []
    if "step" not in names:
        os.replace(path, f"{path}.damaged")
        return f"{path} had no readable header (a power cut?); moved it to {path}.damaged and started a new one"
    steps = [_row_step(line, len(names), names.index("step")) for line in lines[1:]]
    bad = [line for line, step in zip(lines[1:], steps) if step is None]
    if not bad:
        return None
    kept = [line for line, step in zip(lines[1:], steps) if step is not None]
    last = next((s for s in reversed(steps) if s is not None), None)
    what = "NUL bytes, what a power cut leaves" if any(b"\0" in line for line in bad) else "partial or malformed rows"
    _replace(path, b"".join([header, *kept]))
    after = f"after the row of step {last}" if last is not None else "after the header"
    return f"{path}: dropped {len(bad)} damaged line(s) of {sum(map(len, bad))} bytes ({what}) {after}; the other rows are kept"


def drop_rows_from(path: str, step: int) -> None:
    """Removes the rows of ``step`` and later steps from the metrics file ``path`` (if any); the
    rows kept are unchanged byte for byte."""
    if not os.path.isfile(path):
        return
    with open(path, newline="") as file:
        lines = file.read().splitlines(keepends=True)
    if len(lines) < 2:
        return
    column = next(csv.reader([lines[0]])).index("step")
    kept = [line for line in lines[1:] if int(float(next(csv.reader([line]))[column])) < step]
    if len(kept) < len(lines) - 1:
        _replace(path, "".join([lines[0], *kept]))


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

    @rank_zero_only
    def drop_after(self, step: int) -> None:
        """Removes the rows of steps after ``step`` (the one a resumed run continues from): a course
        left by resuming from an older checkpoint, or a killed run's rows after its last checkpoint."""
        drop_rows_from(self.experiment.metrics_file_path, step + 1)

    @rank_zero_only
    def sync(self) -> None:
        """Writes the pending rows and makes ``metrics.csv`` durable (fsync)."""
        self.save()
        path = self.experiment.metrics_file_path
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class LogConfig(L.Callback):
    """Gives each logger the run's resolved config as its hyperparameters when fitting starts
    (wandb's run config, TensorBoard's HPARAMS tab; the CSV logger is left out: the run
    directory's ``config.yaml`` is that record already), and ends a wandb run when fitting ends,
    so the next job of a ``--multirun`` sweep starts its own run instead of reusing this one.

    Args:
        config: the resolved config, plain containers (``OmegaConf.to_container(cfg, resolve=True)``).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:
            if not isinstance(logger, CSVLogger):
                logger.log_hyperparams(self.config)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero and logger._experiment is not None:
                logger.experiment.finish()


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether the current optimizer step writes a row to the loggers.

    Every ``trainer.log_every_n_steps`` optimizer steps, and the last step of the run. For hooks
    that run after the optimizer step, when ``trainer.global_step`` already counts it.
    """
    step, every = trainer.global_step, trainer.log_every_n_steps
    return (every > 0 and step % every == 0) or step == trainer.max_steps
