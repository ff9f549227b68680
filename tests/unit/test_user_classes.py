"""validate asks a user's class named by ``_target_`` for what plait calls on it: an objective that
is no `trainer.protocols.Objective`, lacks ``num_tokens`` or takes ``loss_sum(self, batch)``, a
callback that is no Lightning callback, a strategy that is no `strategies.mesh.MeshStrategy`, and a
strategy subclass's mistyped setting passed on through ``**kwargs`` (a reviewer's, each a traceback
at launch after the run directory was written)."""

from __future__ import annotations

import sys
import types

import lightning as L
import pytest
from harness import compose_config

from strategies.mesh import MeshStrategy
from trainer.config import ConfigError, validate
from trainer.protocols import Objective


class NoTokens(Objective):
    def loss_sum(self, model, batch):
        return model(batch["input_ids"]).sum()


class WrongSignature(Objective):
    def num_tokens(self, batch):
        return batch["labels"].numel()

    def loss_sum(self, batch):
        return batch["labels"].sum()


class Static(Objective):  # a static method takes what the Task passes (a reviewer's false refusal)
    @staticmethod
    def num_tokens(batch):
        return batch["labels"].numel()

    @staticmethod
    def loss_sum(model, batch):
        return model(batch["input_ids"]).sum()


class ClassMethods(Objective):  # a class method's cls is bound already
    @classmethod
    def num_tokens(cls, batch):
        return batch["labels"].numel()

    @classmethod
    def loss_sum(cls, model, batch):
        return model(batch["input_ids"]).sum()


class NotAnObjective:
    def num_tokens(self, batch): ...

    def loss_sum(self, model, batch): ...


class NotACallback:
    pass


class Tagged(MeshStrategy):
    def __init__(self, *args, tag: str = "x", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


class MoreTagged(Tagged):
    def __init__(self, *args, extra: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra = extra


class Popping(MeshStrategy):
    def __init__(self, *args, **kwargs):
        self.alpha = kwargs.pop("alpha", 0.5)  # a setting read out of **kwargs
        super().__init__(*args, **kwargs)


class Note(L.Callback):
    pass


@pytest.fixture(autouse=True)
def user_module(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("my_classes")
    for cls in (
        NoTokens,
        WrongSignature,
        Static,
        ClassMethods,
        NotAnObjective,
        NotACallback,
        Tagged,
        MoreTagged,
        Popping,
        Note,
    ):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "my_classes", module)


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["model=nano", "data.seq_len=64", *overrides]))
    return err.value.problems


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("NoTokens", "objective NoTokens does not define num_tokens(self, batch); the Task calls it every step"),
        ("WrongSignature", "objective WrongSignature.loss_sum(self, batch) cannot be called as loss_sum(self, model, batch)"),
        ("NotAnObjective", "NotAnObjective is not a trainer.protocols.Objective; subclass it"),
    ],
)  # fmt: skip
def test_an_objective_plait_cannot_call_is_refused(target: str, expected: str) -> None:
    problems = _problems("~objective", f"+objective._target_=my_classes.{target}")
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("target", ["Static", "ClassMethods"])
def test_an_objective_of_static_or_class_methods_passes(target: str) -> None:
    validate(
        compose_config(["model=nano", "data.seq_len=64", "~objective", f"+objective._target_=my_classes.{target}"])
    )


def test_a_callback_that_is_no_lightning_callback_is_refused_and_one_that_is_passes() -> None:
    problems = _problems("+callbacks.x._target_=my_classes.NotACallback")
    assert (
        len(problems) == 1
        and problems[0].startswith("callbacks.x._target_=")
        and problems[0].endswith("NotACallback is not a Lightning callback; subclass lightning.pytorch.Callback")
    ), problems
    validate(compose_config(["model=nano", "data.seq_len=64", "+callbacks.x._target_=my_classes.Note"]))


def test_a_strategy_that_is_no_mesh_strategy_is_refused() -> None:
    problems = _problems("strategy._target_=lightning.pytorch.strategies.DDPStrategy")
    assert len(problems) == 1 and problems[0].startswith(
        "strategy._target_=lightning.pytorch.strategies.ddp.DDPStrategy is not a strategies.mesh.MeshStrategy"
    ), problems


def test_a_strategy_subclass_setting_is_checked_against_its_base() -> None:
    """Tagged takes ``tag`` and passes **kwargs on to MeshStrategy: a mistyped key was a TypeError at
    launch. Settings of every class up the chain pass (MoreTagged's own and Tagged's), and a key
    close to none of them may be one a class reads out of **kwargs itself (Popping's alpha)."""
    problems = _problems("strategy._target_=my_classes.Tagged", "+strategy.tga=hi")
    assert problems == [
        "unknown key strategy.tga (did you mean tag?); my_classes.Tagged and the classes it passes **kwargs to take: "
        "tag, timeout_s, heartbeat_s, cpu_allocator"
    ]
    for overrides in (
        ["strategy._target_=my_classes.Tagged", "+strategy.tag=y", "strategy.heartbeat_s=5"],
        ["strategy._target_=my_classes.MoreTagged", "+strategy.tag=y", "+strategy.extra=2"],
        ["strategy._target_=my_classes.Popping", "+strategy.alpha=0.1"],
    ):
        validate(compose_config(["model=nano", "data.seq_len=64", *overrides]))
