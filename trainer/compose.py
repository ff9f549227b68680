"""Recipes and config composition, shared by every command of the table (`trainer.commands`).

A recipe is a YAML file of ``recipes/`` (or a path of one's own) whose defaults list picks one
option of each config group of ``conf/``. An alias is a recipe name that stands for a recipe
and some overrides: ``plait dpo`` is ``plait preference objective=dpo recipe=dpo`` (the same
composed config, so its run directories keep their ``runs/dpo/...`` names). A command that
takes no recipe (generate, export, merge) composes its own file ``conf/<command>.yaml``.

Every command reports bad input the same way: one ``plait: error:`` line naming the fix, exit 2.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
import typing
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.catalog import ALIASES, CONF_DIR, DEFAULT_RECIPE, RECIPES_DIR, bundled_recipes, fail
from trainer.finetune_defaults import choose_lr
from trainer.model_node import init_from_of

# trainer.rundir, trainer.init_from and strategies.core.ranges import torch (~3 s): they are
# imported where used, so that plait compare, plait RECIPE --cfg job and a sweep's resolvers start in
# a fraction of a second.

# Hydra's flags that take a value (``--info`` takes one only from its choices).
_VALUED_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-dir", "-cd", "--experimental-rerun")
_INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def _task_overrides() -> list[str]:
    """The current Hydra job's overrides as typed (none outside a job: `compose`, preflight)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def swept_keys(overrides: Sequence[str]) -> list[str]:
    """The keys that ``overrides`` sweep (``optim.lr=1e-3,3e-4``, ``model=nano,tiny``, ``range(...)``), no ``+``/``~``."""
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o and not o.startswith("-")])
    return [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]


def _run_name(recipe: str) -> str:
    """``${plait.run_name:${recipe}}``: the recipe and the job's overrides (`trainer.rundir.run_name`)."""
    from trainer.rundir import run_name  # lazy: torch (see the imports above)

    implied = set(ALIASES[recipe][1]) if recipe in ALIASES else set()
    return run_name(recipe, [o for o in _task_overrides() if o not in implied])


def _job_dir(num: int) -> str:
    """``${plait.job_dir:${hydra.job.num}}``: a sweep job's directory named by the values it sweeps
    (`trainer.rundir.job_dirname`); the sweep is the command line's (``sys.argv``, Hydra's argv)."""
    from trainer.rundir import job_dirname  # lazy: torch (see the imports above)

    swept = set(swept_keys(hydra_config(sys.argv[1:])[2])) if "--config-path" in sys.argv else set()
    return job_dirname(int(num), [o for o in _task_overrides() if o.split("=", 1)[0].lstrip("+~") in swept])


def register_resolvers() -> None:
    """Registers ``${plait.run_name:...}``, ``${plait.job_dir:...}`` (conf/logger, conf/plait_base.yaml)
    and ``${plait.lr:...}`` (the recipes' learning rates: `trainer.finetune_defaults`)."""
    for name, resolver in (("plait.run_name", _run_name), ("plait.job_dir", _job_dir), ("plait.lr", choose_lr)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def error_message(err: BaseException) -> str:
    """First line of the most specific message in an exception chain (Hydra often wraps an empty one)."""
    while not str(err).strip() and err.__cause__ is not None:
        err = err.__cause__
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def split_recipe(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``[RECIPE] overrides`` -> (recipe, overrides); the recipe defaults to ``pretrain``."""
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        return argv[0], list(argv[1:])
    return DEFAULT_RECIPE, list(argv)


def to_hydra_argv(argv: list[str]) -> list[str]:
    """``[RECIPE] overrides`` -> ``--config-path DIR --config-name NAME overrides hydra.searchpath=[...]``.

    Idempotent: an argv that already names its config (a child process) is returned unchanged.
    An alias expands to its recipe and overrides, before the user's.

    Raises:
        SystemExit: RECIPE is neither a bundled recipe, an alias nor an existing YAML file.
    """
    if any(a.startswith(("--config-name", "-cn")) for a in argv):
        return argv
    recipe, rest = split_recipe(argv)
    if recipe in ALIASES:
        recipe, implied, _ = ALIASES[recipe]
        rest = [*implied, *rest]
    if recipe.endswith((".yaml", ".yml")) or os.sep in recipe:
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            fail(f"recipe file {recipe} does not exist")
        config = ["--config-path", str(path.parent), "--config-name", path.stem]
    else:
        if recipe not in bundled_recipes():
            fail(
                f"unknown recipe {recipe!r}; bundled recipes: {', '.join(bundled_recipes())}, or a path to a .yaml file"
            )
        config = ["--config-path", str(RECIPES_DIR), "--config-name", recipe]
    search = f"hydra.searchpath=['file://{CONF_DIR}','file://{RECIPES_DIR}']"
    flags, overrides = _split_flags(rest)
    _refuse_foreign_flags(flags)
    recipe_file = Path(config[1]) / f"{config[3]}.yaml"
    overrides = select_transforms(overrides, _defaults_keys(recipe_file))
    return config + flags + [a for o in overrides for a in replace_sources(o)] + [search]


def transform_groups() -> tuple[str, ...]:
    """The model transforms a run adds to its strategy (``conf/strategy/<name>/``: lora, mixout, sat)."""
    return tuple(sorted(p.name for p in (CONF_DIR / "strategy").iterdir() if p.is_dir()))


def _defaults_keys(recipe_file: Path) -> set[str]:
    """The group keys a recipe file selects: its defaults list's (``strategy/lora`` from ``- /strategy/lora:
    default``) and each transform it writes out itself (``strategy: {lora: {...}}``, as the run's own
    config.yaml does under ``plait resume``)."""
    try:
        recipe = yaml.safe_load(recipe_file.read_text()) or {}
        defaults = recipe.get("defaults") or []
        strategy = recipe.get("strategy") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return set()  # Hydra reports an unreadable recipe itself
    keys = (next(iter(entry)) for entry in defaults if isinstance(entry, dict) and entry)
    written = (
        {f"strategy/{name}" for name, node in strategy.items() if isinstance(node, dict)}
        if isinstance(strategy, dict)
        else set()
    )
    return {key.removeprefix("override ").strip().strip("/").split("@")[0] for key in keys} | written


def select_transforms(overrides: Sequence[str], recipe_defaults: set[str]) -> list[str]:
    """A transform group switched on without Hydra's ``+``: ``strategy/lora=default`` ->
    ``+strategy/lora=default``, and a field of one not selected (``strategy.lora.rank=16``) selects
    its ``default`` option first (``+strategy/lora=default strategy.lora.rank=16``), as users of
    PEFT expect a LoRA setting to turn LoRA on. A recipe whose defaults list holds the group, or an
    override that selects it (with or without ``+``), is left to Hydra's own rules."""
    out: list[str] = []
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for override in overrides:
        key = override.split("=", 1)[0]
        for name in transform_groups():
            group = f"strategy/{name}"
            if group in recipe_defaults:
                continue
            if key == group and "=" in override:
                override = "+" + override
            elif key.lstrip("+").startswith(f"strategy.{name}.") and group not in keys:
                out.append(f"+{group}=default")
                keys.add(group)
                if override.startswith("+") and not override.startswith("++"):
                    override = override[1:]  # the field exists once the group is selected
        out.append(override)
    return out


def replace_sources(override: str) -> list[str]:
    """``data.sources={mine: {...}}`` -> ``~data.sources +data.sources={mine: {...}}``: a mapping
    given for ``data.sources`` (or a prompt data's ``data.rewards``) replaces the preset's named
    entries (Hydra would merge it into them, and refuse a new name in struct mode); any other
    override is kept as it is."""
    key, _, value = override.partition("=")
    if key.strip() in ("data.sources", "data.rewards") and value.lstrip().startswith("{"):
        return [f"~{key.strip()}", f"+{key.strip()}={value}"]
    return [override]


# Hydra's own flags (its argparse), which go to Hydra as they are; ``-m``/``--multirun`` included.
_HYDRA_FLAGS = (
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
    "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i",
)  # fmt: skip


def _refuse_foreign_flags(flags: Sequence[str]) -> None:
    """A flag that is not Hydra's (``--max_steps 5``, ``--lr=1e-3``: other trainers' command lines):
    plait takes ``key=value`` overrides; names plait's key where it knows the name (`trainer.foreign_names`).

    Raises:
        SystemExit: such a flag (exit 2), one line.
    """
    from trainer.foreign_names import plait_override  # lazy: the flag is rare

    for i, flag in enumerate(flags):
        name, _, value = flag.partition("=")
        if not name.startswith("-") or name in _HYDRA_FLAGS or flags[i - 1 if i else 0] in _VALUED_FLAGS and i:
            continue
        key = name.lstrip("-")
        fix = plait_override(key, value or "...") or f"{key}=..."
        fail(f"{flag}: plait takes overrides as key=value, not flags: {fix} (plait RECIPE --help lists the keys)")


def _split_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides), each in order. Hydra's parser takes the
    overrides only as one run of positional arguments, so ``plait dpo --cfg job`` (overrides
    implied before the flag) must not leave overrides on both sides of a flag."""
    flags, overrides, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            overrides.append(arg)
        else:
            flags.append(arg)
            takes = arg in _VALUED_FLAGS or (
                arg in ("--info", "-i") and i + 1 < len(args) and args[i + 1] in _INFO_CHOICES
            )
            if takes and i + 1 < len(args):
                i += 1
                flags.append(args[i])
        i += 1
    return flags, overrides


def hydra_config(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """(config dir, config name, overrides) of an argv from `to_hydra_argv`."""
    argv = list(argv)
    config_dir, config_name = argv[argv.index("--config-path") + 1], argv[argv.index("--config-name") + 1]
    overrides = [a for a in argv if not a.startswith("-") and a not in (config_dir, config_name)]
    return config_dir, config_name, overrides


def compose(recipe: str = DEFAULT_RECIPE, overrides: Sequence[str] = ()) -> DictConfig:
    """The config the CLI would compose for ``plait RECIPE overrides``, without starting a Hydra job.

    For the commands and for scripts and tests that build and fit in-process
    (``trainer.build.build_run``). A plait run as ``model.init_from`` brings its model node
    (`trainer.init_from.take_run_model`). The config is not validated (``trainer.config.validate``
    does that).

    Args:
        recipe: a bundled recipe name, an alias or the path of a recipe .yaml file.
        overrides: Hydra overrides, e.g. ``["model=nano", "trainer.max_steps=10"]``.

    Raises:
        SystemExit: RECIPE is neither a bundled recipe nor an existing YAML file.
        hydra.errors.HydraException: an override does not apply.
        trainer.targets.UntrustedTargetError: the run ``model.init_from`` names has a model node
            that names code outside plait and ``trust`` (nothing of it was built).
    """
    from trainer.init_from import take_run_model  # lazy: torch (see the imports above)

    register_resolvers()
    config_dir, config_name, rest = hydra_config(to_hydra_argv([recipe, *overrides]))
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return take_run_model(drop_null_sources(hydra_compose(config_name, overrides=rest)), rest)


def drop_null_sources(cfg: DictConfig) -> DictConfig:
    """``cfg`` (changed in place and returned) without the ``data.sources`` entries set to null: a
    recipe file (``data: {sources: {general: null, mine: {...}}}``, which Hydra merges into the
    preset's sources) or an override (``data.sources.general=null``) removes a preset's source so."""
    sources = OmegaConf.select(cfg, "data.sources", default=None, throw_on_missing=False)
    if isinstance(sources, DictConfig):
        with open_dict(sources):  # Hydra's configs are in struct mode
            raw = OmegaConf.to_container(sources, resolve=False)  # None, not an interpolation resolved
            for name in [n for n, node in raw.items() if node is None]:
                del sources[name]
    return cfg


def adopt_run_model(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """`trainer.init_from.take_run_model`, its refusal of a run's model as one
    ``plait: error:`` line (exit 2) where preflight has not checked it (children, sweeps, --help)."""
    if init_from_of(cfg.get("model")) is None:
        return cfg  # no run to take a model from: plait RECIPE --help answers without torch
    from trainer.init_from import take_run_model  # lazy: torch (see the imports above)
    from trainer.targets import UntrustedTargetError  # lazy: torch (see the imports above)

    try:
        return take_run_model(cfg, overrides)
    except UntrustedTargetError as err:
        fail(str(err))


def compose_command(
    name: str, argv: Sequence[str], *, usage: str, lists: Sequence[str] = (), ranges: Callable[..., Any] | None = None
) -> DictConfig:
    """``conf/<name>.yaml`` with the ``key=value`` arguments of ``plait <name>``, every field given.

    Args:
        ranges: a function whose parameters declare the ranges (`strategies.core.ranges.Range`) of the
            fields of the same names (``generate``'s ``top_k``: `trainer.sampling.sample`'s), and
            their kinds (`declared_kinds`: an ``int`` takes no fraction, ``| None`` takes null).

    Raises:
        SystemExit: (exit 2, ``plait: error:`` with ``usage``) an argument does not parse or does
            not apply, a required field (``???``) is missing, a value has another type than the
            field's default (`command_type_problems`; ``lists`` names fields that take a list), or
            a number is outside the range ``ranges`` declares for it.
    """
    defaults = yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())
    for arg in argv:
        key = arg.partition("=")[0].lstrip("+~").split(".")[0]
        if "=" in arg and key not in defaults and not key.startswith("hydra"):
            close = difflib.get_close_matches(key, [str(k) for k in defaults], n=1)
            fail(
                f"{key}: plait {name} has no such argument{f'; did you mean {close[0]}?' if close else ''} "
                f"(it takes {', '.join(str(k) for k in defaults)}; usage: {usage})"
            )
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(name, overrides=list(argv))
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException) as err:
        fail(f"{error_message(err)} (usage: {usage}; a value with a comma or space needs inner quotes: key=\"'a, b'\")")
    integers, nullable = declared_kinds(ranges) if ranges is not None else (set(), set())
    problems = command_type_problems(cfg, defaults, lists=lists, integers=integers, nullable=nullable)
    if not problems and ranges is not None:
        from strategies.core.ranges import declared_ranges, value_problem  # lazy: torch (see the imports above)

        declared = declared_ranges(ranges).items()
        problems = [p for key, allowed in declared if key in cfg and (p := value_problem(key, cfg[key], allowed))]
    if problems:
        fail(f"{problems[0]} (usage: {usage})")
    return cfg


def declared_kinds(fn: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """``(integers, nullable)``: the parameters of ``fn`` annotated ``int`` (not float) and those
    that take None (``int | None``), read through ``Annotated``."""
    integers, nullable = set(), set()
    for name, hint in typing.get_type_hints(fn, include_extras=True).items():
        kinds = (
            typing.get_args(hint)
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            else (hint,)
        )
        kinds = tuple(typing.get_args(k)[0] if typing.get_origin(k) is typing.Annotated else k for k in kinds)
        if int in kinds and float not in kinds:
            integers.add(name)
        if type(None) in kinds:
            nullable.add(name)
    return integers, nullable


def command_type_problems(
    cfg: DictConfig,
    defaults: dict,
    *,
    lists: Sequence[str] = (),
    integers: Collection[str] = (),
    nullable: Collection[str] = (),
) -> list[str]:
    """Each field of a command's config whose value has another type than its default's, with the fix.

    A field whose default is text or ``???`` (a required path) takes text; a number default takes a number, a bool default true/false, a list default
    (or a field named in ``lists``) a list of texts; null defaults are left to the command. Hydra parses ``prompt=42`` as an int and
    ``out=[a]`` as a list: without this check both end in a traceback far from the argument. A field in
    ``integers`` takes no fraction (``max_new_tokens=1.5``), one in ``nullable`` also takes null
    (``top_k=null``: every token).
    """
    values = OmegaConf.to_container(cfg, resolve=True)
    problems = []
    for key, default in defaults.items():
        value = values.get(key)
        if default is None or (value is None and key in nullable):
            continue  # null defaults (export's dtype, merge's weights) are checked by their command
        if key in lists or isinstance(default, list):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                problems.append(f"{key}={value!r} must be a list of texts, e.g. {key}=[a,b]")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                problems.append(f"{key}={value!r} must be true or false")
        elif isinstance(default, (int, float)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                problems.append(f"{key}={value!r} must be a number, e.g. {key}={default}")
            elif key in integers and not isinstance(value, int):
                problems.append(f"{key}={value!r} must be a whole number, e.g. {key}={default}")
        elif isinstance(value, (list, dict)):
            problems.append(f"{key}={value} must be one text, not a {type(value).__name__}; give one value: {key}=...")
        elif not isinstance(value, str):
            problems.append(f"{key}={value} must be text; quote it: {key}=\"'{value}'\"")
    return problems
