"""What a run that fails before it trains leaves behind: nothing. A refused start (bad config,
data, chat template or checkpoint) exits 2 with one line and removes the run directory it made;
a fresh run that fails before its first optimizer step removes it too (`trainer.run.run` wraps its
start and its fit in these)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L

from strategies.checkpoint.dcp import CheckpointError
from trainer.config import ConfigError
from trainer.data.base import DataError
from trainer.data.chat import ChatError
from trainer.nonfinite import NonFiniteError


@contextmanager
def refused_start(run_dir: Path, launching: bool, fresh_dir: bool) -> Iterator[None]:
    """A failed start leaves nothing behind, whatever failed (``fresh_dir``: ``run_dir`` held
    nothing before it); bad input (config, data, chat template, checkpoint) exits 2 with one
    ``plait: error:`` line."""
    try:
        yield
    except BaseException as err:
        if launching and fresh_dir and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
        if isinstance(err, (ConfigError, DataError, ChatError, CheckpointError)):
            print(f"plait: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        raise


@contextmanager
def nothing_left_untrained(run_dir: Path, fresh: bool, trainer: L.Trainer) -> Iterator[None]:
    """A fresh run that fails before its first optimizer step (a user's objective, reward function
    or callback that raises on the first batch) leaves no run directory behind, as a refused start
    does (`refused_start`): nothing in it was trained. The global-zero rank removes it and says so."""
    try:
        yield
    except BaseException as err:
        # A divergence stop is a result (its row and summary.json say where it stopped), even at step 1.
        stopped = isinstance(err, NonFiniteError)
        if fresh and not stopped and trainer.is_global_zero and trainer.global_step == 0 and run_dir.is_dir():
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"plait: nothing was trained; the run directory {run_dir} is removed", file=sys.stderr, flush=True)
        raise
