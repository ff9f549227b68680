"""Which ``_target_``s a run directory's ``config.yaml`` may instantiate.

A run directory may come from anywhere, and Hydra's ``instantiate`` calls whatever callable a
``_target_`` names (``torch.load``, ``subprocess.Popen``, ...). Commands that build objects from
a run directory's config (``generate``, ``export``, ``merge``) first pass it through
`check_targets`: every ``_target_`` must be a class (or a function returning a torch module, a
model factory) *defined* in plait's own packages, or in a package the user trusts by name
(``trust=[my_pkg]``). The package is checked before anything is imported, so an untrusted
module is never imported either.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

PLAIT_PACKAGES = ("trainer", "strategies")


class UntrustedTargetError(ValueError):
    """A run directory's config names a ``_target_`` outside the trusted packages."""


def _targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every ``_target_`` in a nested config (interpolations unresolved:
    an interpolated target is refused rather than resolved)."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        for name, value in node.items():
            if name == "_target_":
                yield key, value
            else:
                yield from _targets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{key}[{i}]")


def _problem(target: Any, allowed: set[str]) -> str | None:
    """Why ``target`` may not be instantiated, or None."""
    if not isinstance(target, str) or "." not in target:
        return "is not a dotted class path"
    if "${" in target:
        return "is an interpolation (plait saves a run's config resolved)"
    package = target.split(".")[0]
    if package not in allowed and package in sys.stdlib_module_names:  # trusting it would let any config run code
        return "is in Python's standard library, which a run's config never needs: do not use this run directory"
    if package not in allowed:
        return f"is outside plait's packages (trust its package with trust=[{package}])"
    module_name, _, name = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        return (
            f"cannot be imported ({err}); a package of your own: name its folder with plait --user-path DIR "
            "(or PLAIT_USER_PATH), the current folder is not searched"
        )
    if not (inspect.isclass(obj) or _is_model_factory(obj)):
        return "is neither a class nor a function returning a torch module (other callables may do anything)"
    if obj.__module__.split(".")[0] not in allowed:
        return f"is {obj.__module__}.{obj.__qualname__}, defined outside the trusted packages"
    return None


def _is_model_factory(obj: Any) -> bool:
    """A function annotated to return an ``nn.Module`` subclass (``model=hf``'s ``llama_from_hf``)."""
    if not inspect.isfunction(obj):
        return False
    try:
        returned = typing.get_type_hints(obj).get("return")
    except (NameError, TypeError):
        return False
    return inspect.isclass(returned) and issubclass(returned, nn.Module)


def check_targets(node: Any, *, source: str, key: str = "", trust: Sequence[str] = ()) -> None:
    """Refuses ``node`` (a config read from a run directory) unless every ``_target_`` in it is
    a class defined in plait's packages or in ``trust``.

    Args:
        source: the file the node was read from, for the message.
        key: the node's dotted key in that file (``model``).
        trust: more top-level package names the user trusts.

    Raises:
        UntrustedTargetError: naming every refused target and the fix.
    """
    allowed = {*PLAIT_PACKAGES, *map(str, trust)}
    problems = []
    for where, target in _targets(node, key):
        if (why := _problem(target, allowed)) is not None:
            problems.append(f"{where}._target_={target} {why}")
    if problems:
        raise UntrustedTargetError(
            f"{source} names objects plait will not build from a run directory: {'; '.join(problems)}. "
            f"Only classes of plait (and of packages given with trust=[...]) are instantiated from a run directory"
        )
