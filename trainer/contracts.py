"""What validate asks of a class a user's ``_target_`` names, beyond its arguments: that it is the
kind of object its node is read as, with the methods plait calls, callable as plait calls them.

Each was a traceback at launch, after the data was prepared and the run directory written (a
reviewer's objective without ``num_tokens``, a ``loss_sum(self, batch)``, a callback that is no
Lightning ``Callback``, a strategy that is no `strategies.mesh.MeshStrategy`).
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L

from strategies.mesh import MeshStrategy
from trainer.protocols import Objective

# The methods the Task calls on every objective and the arguments it passes (after ``self``).
OBJECTIVE_METHODS = {"num_tokens": ("batch",), "loss_sum": ("model", "batch")}


def _name(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def objective_problems(cls: Any) -> list[str]:
    """Why the objective class ``cls`` cannot train: not a `trainer.protocols.Objective` subclass (its
    optional hooks' defaults live there), or a method of `OBJECTIVE_METHODS` it does not define or
    that cannot take the Task's arguments. [] when none."""
    if not inspect.isclass(cls) or Objective not in cls.__mro__:
        return [
            f"objective._target_={_name(cls)} is not a trainer.protocols.Objective; subclass it "
            "(class Mine(Objective), see docs/extending.md)"
        ]
    problems = []
    for method, args in OBJECTIVE_METHODS.items():
        call = f"{method}(self, {', '.join(args)})"
        member = getattr(cls, method)
        if member is getattr(Objective, method):
            problems.append(
                f"objective {cls.__name__} does not define {call}; the Task calls it every step (docs/extending.md)"
            )
            continue
        # self, unless a static or class method (a class method's cls is bound already)
        bound = () if isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod)) else (None,)
        try:
            inspect.signature(member).bind(*bound, *args)
        except TypeError:
            problems.append(
                f"objective {cls.__name__}.{method}{inspect.signature(member)} cannot be called as {call}; "
                f"give it that signature"
            )
        except ValueError:  # no signature to read (a builtin): the first step tells
            continue
    return problems


def callback_problem(cls: Any, where: str) -> str | None:
    """Why the class of the callback node ``where`` (``callbacks.<name>``) cannot be one, or None."""
    if inspect.isclass(cls) and issubclass(cls, L.Callback):
        return None
    return f"{where}._target_={_name(cls)} is not a Lightning callback; subclass lightning.pytorch.Callback"


def strategy_problem(cls: Any) -> str | None:
    """Why the class of ``strategy._target_`` cannot be plait's strategy, or None."""
    if inspect.isclass(cls) and issubclass(cls, MeshStrategy):
        return None
    return (
        f"strategy._target_={_name(cls)} is not a strategies.mesh.MeshStrategy; subclass it (or one of "
        "plait's strategies: docs/extending.md), Lightning's own strategies do not run plait's step"
    )
