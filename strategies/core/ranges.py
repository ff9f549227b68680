"""Declared numeric ranges of config fields, and the checks `trainer.config.validate` runs on them (here, under strategies/, so both packages declare them).

A plait constructor or config dataclass declares a field's range in its annotation::

    warmup_steps: Annotated[int, Range(min=0)] = 0
    heartbeat_s: Annotated[float, Range(min=0)] | None = 60.0

validate refuses a config value outside it, and a NaN or infinite value of any numeric field
(no field of a plait run means anything with them), naming the key and the range. The fields of
classes plait does not own (torch optimizers) are checked by their own constructors instead
(`optimizer_problem`: the configured optimizer is built on one dummy parameter and steps it once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of allowed values; None: unbounded on that side.

    Attributes:
        min, max: the bounds.
        min_open, max_open: the bound itself is excluded (``Range(min=0, min_open=True)``: > 0).
    """

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def __contains__(self, value: float) -> bool:
        low_ok = self.min is None or (value > self.min if self.min_open else value >= self.min)
        high_ok = self.max is None or (value < self.max if self.max_open else value <= self.max)
        return low_ok and high_ok

    def __str__(self) -> str:
        low, high = _number(self.min), _number(self.max)
        if self.max is None:
            return f"{'>' if self.min_open else '>='} {low}" if self.min is not None else "a number"
        if self.min is None:
            return f"{'<' if self.max_open else '<='} {high}"
        return f"in {'(' if self.min_open else '['}{low}, {high}{')' if self.max_open else ']'}"


def _number(value: float | None) -> str:
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


POSITIVE = Range(min=0, min_open=True)
NON_NEGATIVE = Range(min=0)
FRACTION = Range(min=0, max=1)


def _range_of(hint: Any) -> Range | None:
    """The `Range` in an ``Annotated`` hint, also inside ``X | None``."""
    if typing.get_origin(hint) is typing.Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((found for arg in typing.get_args(hint) if (found := _range_of(arg)) is not None), None)
    return None


def declared_ranges(target: Any) -> dict[str, Range]:
    """``{field: Range}`` declared by a dataclass, a function, or a class's ``__init__`` and those of
    its bases (a subclass passing ``**settings`` on keeps its base's ranges)."""
    if isinstance(target, type) and not dataclasses.is_dataclass(target):
        found: dict[str, Range] = {}
        for cls in reversed(target.__mro__):
            if "__init__" in vars(cls) and cls is not object:
                found.update(_declared(vars(cls)["__init__"]))
        return found
    return _declared(target)


def _declared(obj: Any) -> dict[str, Range]:
    try:
        hints = typing.get_type_hints(obj, include_extras=True)
    except Exception:  # noqa: BLE001 - annotations that do not resolve declare nothing
        return {}
    return {name: found for name, hint in hints.items() if (found := _range_of(hint)) is not None}


def value_problem(key: str, value: Any, allowed: Range | None) -> str | None:
    """Why ``key=value`` is out of range (NaN/inf always), or None; non-numbers are not checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}={value} must be a finite number" + (f" {allowed}" if allowed is not None else "")
    if allowed is not None and value not in allowed:
        return f"{key}={value} must be {allowed}"
    return None


def range_problems(target: Any, items: Iterable[tuple[str, Any]], where: str = "") -> list[str]:
    """The out-of-range values among ``items`` (key, value) of the node ``where`` built by ``target``
    (each named ``where.key``; ``key`` alone without ``where``, e.g. a function's own arguments)."""
    ranges = declared_ranges(target)
    return [
        p for key, value in items if (p := value_problem(f"{where}.{key}" if where else key, value, ranges.get(key)))
    ]


def optimizer_problem(optimizer: Callable[..., torch.optim.Optimizer] | None) -> str | None:
    """The configured optimizer's own refusal of its values, or None: it is built on one dummy
    parameter (torch's optimizers check lr, betas, eps, weight_decay, momentum in their
    constructors) and steps it once (what they read only then, e.g. three ``betas`` for AdamW)."""
    if optimizer is None:
        return None
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    try:
        built = optimizer([param])
    except Exception as err:  # noqa: BLE001 - the optimizer's message names the bad value
        return f"optim: {err}; fix that optim.* value"
    try:
        built.step()
    except Exception as err:  # noqa: BLE001 - a step's message names no key: the values are listed
        given = optimizer.keywords if isinstance(optimizer, functools.partial) else {}  # Hydra's _partial_: true
        settings = ", ".join(f"{k}={v}" for k, v in given.items()) or "its settings"
        return f"optim: its first step fails ({err}) with {settings}; fix that optim.* value"
    return None
