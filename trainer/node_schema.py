"""A config node against its schema: a dataclass's fields (`check_dataclass`) or a ``_target_``'s
signature (`check_target`): unknown keys (with the closest valid one, or the plait name of a TRL,
LitGPT or torchtune option), types, declared ranges (`strategies.core.ranges`) and required
arguments, every problem appended as one line that names its fix. `trainer.config.validate` runs
them over the composed config.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any

import torch
import typing_extensions
from omegaconf import DictConfig, ListConfig, OmegaConf

from strategies.core.ranges import declared_ranges, value_problem
from trainer.foreign_names import plait_override
from trainer.semantics import _import
from trainer.targets import PLAIT_PACKAGES


def _close(node: DictConfig, key: str, options: list[str], where: str) -> str:
    """`` (did you mean X?)`` for the unknown ``key`` of ``node`` among ``options``; else `` (use optim.lr=...)``
    when ``where`` (its dotted key) is an option name of TRL, LitGPT or torchtune (`trainer.foreign_names`)."""
    if match := difflib.get_close_matches(key, options, n=1):
        return f" (did you mean {match[0]}?)"
    plait = plait_override(where, str(OmegaConf.select(node, key, throw_on_missing=False)))
    return f" (use {plait})" if plait is not None else ""


def check_dataclass(node: Any, schema: type, prefix: str, problems: list[str]) -> None:
    if not isinstance(node, DictConfig):
        problems.append(f"{prefix or 'the config'} must be a mapping, got {type(node).__name__}")
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields and key != "hydra":
            problems.append(
                f"unknown key {prefix}{key}{_close(node, str(key), list(fields), f'{prefix}{key}')}; "
                f"valid keys: {', '.join(fields)}"
            )
    hints = typing.get_type_hints(schema)
    ranges = declared_ranges(schema)
    for name, f in fields.items():
        if name not in node:
            continue
        value = OmegaConf.select(node, name, throw_on_missing=False)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            check_dataclass(node[name], hint, f"{prefix}{name}.", problems)
        elif not type_ok(value, hint):
            problems.append(f"{prefix}{name}={value!r} must be {_type_name(hint)}")
        elif problem := value_problem(f"{prefix}{name}", value, ranges.get(name)):
            problems.append(problem)


def type_ok(value: Any, hint: Any) -> bool:
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence) or hint in (list, tuple):
        if not isinstance(value, (list, tuple, ListConfig)):
            return False
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return len(items) != 1 or all(type_ok(v, items[0]) for v in value)  # list[str]: every item
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is torch.Tensor:
        return False  # a YAML value is never a tensor (e.g. AdamW's lr: float | Tensor)
    return True  # objects and other annotations are checked by their constructors


def _container_ok(value: DictConfig | ListConfig, hint: Any) -> bool:
    """A list (its items too, e.g. ``data.path=[1,2]`` against ``list[str]``) or a mapping against
    the parameter's annotation; a mapping fits any annotation but text, numbers and lists."""
    if isinstance(value, DictConfig):
        return type_ok({}, hint)
    try:
        items = OmegaConf.to_container(value, resolve=True)
    except Exception:  # noqa: BLE001 - an unresolved interpolation is reported where it is used
        return True
    return type_ok(items, hint)


def _shown(value: DictConfig | ListConfig) -> str:
    try:
        return str(OmegaConf.to_container(value, resolve=True))
    except Exception:  # noqa: BLE001
        return str(value)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if typing.get_origin(hint) in (list, tuple, collections.abc.Sequence) and len(args) == 1:
        return f"a list of {_type_name(args[0])}"
    if args:
        return " or ".join(_type_name(a) for a in args)
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def check_target(
    node: Any, where: str, problems: list[str], injected: set[str] = frozenset(), own: Sequence[str] = ()
) -> None:
    if not isinstance(node, DictConfig) or "_target_" not in node:
        from trainer.catalog import config_groups  # lazy: only a node that is no mapping asks

        hint = ""
        if isinstance(node, str) and node in config_groups().get(where, ()):  # model: nano in a recipe file's body
            hint = f"; {node} is a {where} option: choose it in the defaults list (- override {where}: {node}) or as {where}={node}"
        problems.append(f"{where} must be a mapping with a _target_ (a class or function path){hint}")
        return
    try:
        target = _import(node._target_)
    except (ImportError, AttributeError, ValueError) as err:
        problems.append(
            f"{where}._target_={node._target_} cannot be imported ({err}); check the module path (a package of "
            "your own: name its folder with plait --user-path DIR, the current folder is not searched)"
        )
        return
    signature = inspect.signature(target)
    params = {n: p for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL,)}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    names = [n for n, p in params.items() if p.kind is not p.VAR_KEYWORD]
    hints = _hints(target)
    # A user's subclass of a plait class passes its ``**kwargs`` on, up to the plait base's constructor:
    # a key close to one of theirs is a typo (a TypeError at launch, or a setting silently not set).
    passed_on = _passed_on(target) if takes_kwargs else []
    # ``**settings: Unpack[SomeTypedDict]`` (PEP 692) declares the keys a class passes on to its base.
    for p in list(params.values()):
        declared = typing_extensions.get_args(hints.get(p.name)) if p.kind is p.VAR_KEYWORD else ()
        if declared and typing_extensions.is_typeddict(declared[0]):
            takes_kwargs, names = False, names + list(typing.get_type_hints(declared[0]))
            params |= {
                k: inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in names if k not in params
            }
            hints |= typing.get_type_hints(declared[0])
    ranges = declared_ranges(target)
    for key in node.keys():
        if str(key).startswith("_") and str(key).endswith("_"):
            continue
        if key in own and key not in params:  # read by plait itself: a path or null
            value = OmegaConf.select(node, str(key), throw_on_missing=False)
            if value is not None and not isinstance(value, str):
                problems.append(f"{where}.{key}={value!r} must be a path (a string) or null")
            continue
        if key not in params:
            if not takes_kwargs:
                settable = [n for n in names if n not in injected]
                problems.append(
                    f"unknown key {where}.{key}{_close(node, str(key), settable, f'{where}.{key}')}; "
                    f"{node._target_} takes: {', '.join(settable)}"
                )
            elif close := difflib.get_close_matches(
                str(key), [n for n in passed_on if n not in node and n not in injected], n=1
            ):
                problems.append(
                    f"unknown key {where}.{key} (did you mean {close[0]}?); {node._target_} and the classes it "
                    f"passes **kwargs to take: {', '.join(n for n in passed_on if n not in injected)}"
                )
            else:  # passed on to a base class (``**settings``): its declared range still applies
                value = OmegaConf.select(node, str(key), throw_on_missing=False)
                if problem := value_problem(f"{where}.{key}", value, ranges.get(str(key))):
                    problems.append(problem)
            continue
        value = OmegaConf.select(node, str(key), throw_on_missing=False)
        hint = hints.get(str(key), inspect.Parameter.empty)
        if isinstance(value, (DictConfig, ListConfig)) or value is None and key in injected:
            if isinstance(value, (DictConfig, ListConfig)) and not _container_ok(value, hint):
                problems.append(f"{where}.{key}={_shown(value)} must be {_type_name(hint)}")
            continue
        if not type_ok(value, hint):
            problems.append(f"{where}.{key}={value!r} must be {_type_name(hint)}")
        elif problem := value_problem(f"{where}.{key}", value, ranges.get(str(key))):
            problems.append(problem)
    partial = bool(node.get("_partial_", False))
    for name, p in params.items():
        required = p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        if (
            required
            and name not in node
            and name not in injected
            and not (partial and p.kind is p.POSITIONAL_OR_KEYWORD)
        ):
            problems.append(f"{where}.{name} is required by {node._target_}; set {where}.{name}=...")


def _passed_on(target: Any) -> list[str]:
    """The keyword parameters of a user's class ``target`` and of each class up its MRO whose
    constructor the ``**kwargs`` reach, through the nearest plait class (of ``strategies`` or
    ``trainer``) when it takes no ``**kwargs`` itself; [] for a plait class, a function, a class
    outside plait's hierarchy or a chain that ends in ``**kwargs`` (anything may be taken there)."""
    if not inspect.isclass(target) or target.__module__.split(".")[0] in PLAIT_PACKAGES:
        return []
    names: list[str] = []
    for cls in target.__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
        if cls.__module__.split(".")[0] in PLAIT_PACKAGES:
            return [] if any(p.kind is p.VAR_KEYWORD for p in params) else list(dict.fromkeys(names))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return []  # the chain stops in the user's own class: it takes only what it names
    return []


def _hints(target: Any) -> dict[str, Any]:
    function = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - one unresolvable annotation (e.g. WandbLogger's experiment: "Run")
        # The annotations that are objects already are still checked (name: Optional[str], ...);
        # the strings that do not resolve are not.
        return {
            n: p.annotation
            for n, p in inspect.signature(function).parameters.items()
            if not isinstance(p.annotation, str)
        }
