"""A parallelism plugin added from user code, with no edit of plait: a `StrategyPlugin` subclass and a
``strategy.<key>`` node with its ``_target_`` (README, "Your own strategy").
Validate checks its node, `MeshStrategy` walks it after the plugins of ``ORDER``, and each phase it
declares runs: ``apply`` at parallelize, ``step_context`` around every step's forward/backward,
``after_step`` whose metrics reach the Task's history, ``problems`` before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from harness import compose_config, fit, losses
from torch import nn

from strategies.core.parallel_dims import Meshes
from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.plugin import StrategyPlugin
from trainer.config import ConfigError, validate


class StepCounter(StrategyPlugin):
    """Counts the steps it wraps; reports them every ``every`` optimizer steps."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.inside: list[int] = []  # global steps whose forward/backward ran inside step_context
        self.applied_to: list[str] = []
        self.running = False

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        return [] if self.every >= 1 else [f"strategy.toy.every={self.every} must be >= 1"]

    def apply(self, model: nn.Module, meshes: Meshes) -> None:
        self.applied_to.append(type(model).__name__)

    @contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        self.running = True
        try:
            yield
        finally:
            self.running = False
            self.inside.append(step)

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert not self.running and isinstance(optimizer, torch.optim.Optimizer)  # unwrapped from Lightning's
        if step % self.every:
            return {}
        return {
            "toy/steps_inside": float(len(self.inside)),
            "toy/last_inside": float(self.inside[-1]),
            "toy/applied": float(len(self.applied_to)),
        }


TOY = [f"+strategy.toy._target_={__name__}.StepCounter", "+strategy.toy.every=1"]


def test_a_plugin_from_user_code_runs_every_phase_it_declares(tmp_path) -> None:
    cfg = compose_config([*TOY, "trainer.max_steps=2", "optim=sgd"])
    validate(cfg)
    _, task = fit(cfg, tmp_path / "toy")
    steps = [h for h in task.history if "toy/steps_inside" in h]
    assert [(h["toy/steps_inside"], h["toy/last_inside"], h["toy/applied"]) for h in steps] == [
        (1.0, 0.0, 1.0),
        (2.0, 1.0, 1.0),
    ]
    _, reference = fit(compose_config(["trainer.max_steps=2", "optim=sgd"]), tmp_path / "ref")
    assert losses(task.history) == losses(reference.history)  # the toy changes no numerics


def test_a_user_plugins_problems_are_reported_by_validate() -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config([*TOY[:1], "+strategy.toy.every=0"]))
    assert err.value.problems == ["strategy.toy.every=0 must be >= 1"]
    with pytest.raises(ConfigError, match=r"unknown key strategy.toy.evry"):
        validate(compose_config([*TOY[:1], "+strategy.toy.evry=2"]))
