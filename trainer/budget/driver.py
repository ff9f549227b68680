"""The drivers a launch runs instead of one fit: a budget search (``budget=msft``,
`trainer.budget.msft.MSFT`) or self-training rounds (``plait rest``, `trainer.rest.driver.GuidedReST`).

A driver fits runs of its own (each in its own directory under the run directory), so the launch
resumes nothing and trains nothing itself: it checks the config, prepares a budget search's data
once (its roll-outs, forked, find it prepared), and hands the run directory to the driver. The
rounds of ``rest`` make their own data, and resume their own run directory (``resume=last``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from strategies.core.resolved import ResolvedRun
from trainer.build import build_data
from trainer.data.summary import describe

DRIVER_NODES = ("budget", "rest")  # the config nodes that name a driver; a config sets at most one


class DriverError(RuntimeError):
    """A driver's own run failed (its message says which and how to continue); what its finished
    stages wrote stays in the run directory."""


class BudgetSearch(Protocol):
    """A driver node's object: fits runs of its own in ``run_dir``."""

    def run(self, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        """Runs the driver; returns its report (also written under ``run_dir``)."""


def driver_node(cfg: DictConfig) -> str | None:
    """The node of ``cfg`` that names a driver (`DRIVER_NODES`), or None for one run."""
    return next((key for key in DRIVER_NODES if cfg.get(key) is not None), None)


def is_search(cfg: DictConfig) -> bool:
    """Whether ``cfg`` runs a driver (a ``budget`` or ``rest`` node set) rather than one run."""
    return driver_node(cfg) is not None


def run_search(
    cfg: DictConfig, run_dir: Path, run: ResolvedRun, *, say: Callable[[str], None] | None
) -> dict[str, Any]:
    """For a budget search, prepares the data, saying what it holds (`trainer.data.summary.describe`)
    when ``say`` is given (the launching rank); then runs the driver in ``run_dir``.

    Raises:
        DataError: data that cannot be trained on (before any roll-out starts).
    """
    node = driver_node(cfg)
    if node == "budget":
        # The roll-outs fit in forked children of this process (Lightning's fork launcher). A fork of a
        # process whose OpenMP pool has run hangs in its first parallel region (`plait sft data=synthetic
        # budget=msft` with the tiny model did, in roll-out 0's first forward), so this process never
        # starts one: one thread here, inherited by the roll-outs. (ReST fits in processes of its own.)
        torch.set_num_threads(1)
    if say is not None and node == "budget":
        # The roll-outs prepare the same data in forked processes: it is prepared (and refused,
        # and its cuts said) here first, as for a plain run.
        for line in describe(build_data(cfg, run)):
            say(line)
    driver: BudgetSearch = instantiate(cfg[node])
    return driver.run(cfg, run_dir)
