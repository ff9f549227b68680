"""The driver of a budget search (``budget=msft``, `trainer.budget.msft.MSFT`): what a launch runs
instead of one fit when the config names a ``budget`` node.

A search fits runs of its own (roll-outs, each in its own directory under the run directory), so
it resumes nothing and trains nothing itself: the launch checks the config, prepares the data
once (its roll-outs, forked, find it prepared), and hands the run directory to the search.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from hydra.utils import instantiate
from omegaconf import DictConfig

from strategies.core.resolved import ResolvedRun
from trainer.build import build_data
from trainer.data.summary import describe


class BudgetSearch(Protocol):
    """A ``budget`` node's object: searches by fitting runs of its own in ``run_dir``."""

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        """Runs the search; returns its report (also written under ``run_dir``)."""


def is_search(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a budget search (a ``budget`` node set) rather than one run."""
    return cfg.get("budget") is not None


def run_search(
    cfg: DictConfig, run_dir: Path, run: ResolvedRun, *, say: Callable[[str], None] | None
) -> dict[str, Any]:
    """Prepares the data, saying what it holds (`trainer.data.summary.describe`) when ``say`` is
    given (the launching rank), then runs ``cfg.budget``'s search in ``run_dir``.

    Raises:
        DataError: data that cannot be trained on (before any roll-out starts).
    """
    if say is not None:
        # The roll-outs prepare the same data in forked processes: it is prepared (and refused,
        # and its cuts said) here first, as for a plain run.
        for line in describe(build_data(cfg, run)):
            say(line)
    search: BudgetSearch = instantiate(cfg.budget)
    return search.run(cfg, run_dir)
