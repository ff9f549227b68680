"""The train command's first check, Hydra and OmegaConf only: the recipe composed with every
override that does not apply reported at once, each with its fix (a close spelling, a key that
moved, plait's name for a TRL/LitGPT/torchtune option: `trainer.foreign_names`).

A mistyped override of the user's is refused here, before anything imports torch or Lightning
(`trainer.preflight`, seconds): ``plait sft optim.learning_rate=1e-4`` answers in well under 2 s.
The semantic checks (batch sizes, lengths, the layout) run in preflight once the overrides apply.
An alias's own override that fails (``plait kto data=stream``: ``data.unpaired``) goes on to
preflight, where the objective's check names the real fix (see `Composed.implied`).
"""

from __future__ import annotations

import difflib
import inspect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.catalog import ALIASES, bundled_recipes, config_groups, fail
from trainer.compose import error_message, hydra_config
from trainer.foreign_names import FOREIGN_NAMES, plait_override

# difflib's ratio above which a key is a misspelling of another (max_seq_length/max_seq_len 0.88,
# micro_batch/micro_batch_size 0.81) rather than a loose likeness (num_train_epochs/limit_train_batches 0.63).
CLOSE = 0.8
MAX_SWEEP_CHECKS = 32  # --multirun jobs whose overrides are checked before the sweep starts


@dataclass(frozen=True)
class Composed:
    """A recipe composed from a Hydra argv (`trainer.compose.to_hydra_argv`).

    Args:
        cfg: the config with every override that applies (the failed ones left out).
        overrides: the argv's overrides, as typed (with the alias's and the search path).
        problems: one line per override that does not apply, with its fix.
        implied: those of ``problems`` that come from an alias's own overrides.
    """

    cfg: DictConfig
    overrides: list[str]
    problems: list[str] = field(default_factory=list)
    implied: list[str] = field(default_factory=list)

    def refuse_typed(self, job: str = "") -> None:
        """Exits 2 listing the `problems` of overrides the user typed, when there are any (an
        alias's own are then noise: see `implied_failures`); ``job``: the sweep job they fail in."""
        if typed := [p for p in self.problems if p not in self.implied]:
            refuse([f"{p} (in the sweep's job {job})" if job else p for p in typed])


def refuse(problems: Sequence[str]) -> NoReturn:
    """``plait: error: invalid configuration:`` and one ``  - problem`` line each; exit 2."""
    fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def compose_overrides(argv: list[str]) -> Composed:
    """Composes the recipe of ``argv``; when Hydra refuses, tries each override alone to name every
    bad one (a field override under the group choices that compose: ``data=stream data.path=x``
    checks the path as stream's), then composes the rest.

    Raises:
        SystemExit: (exit 2) overrides that fail only together, listed.
    """
    config_dir, config_name, overrides = hydra_config(argv)
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        try:
            return Composed(compose(config_name, overrides=overrides), overrides)
        except (HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
            failed = err
        searchpath = [o for o in overrides if o.startswith("hydra.searchpath")]
        try:  # the recipe alone: a broken recipe file is one problem, not one per override
            compose(config_name, overrides=searchpath)
        except (HydraException, OmegaConfBaseException, yaml.YAMLError) as err:
            refuse([recipe_problem(Path(config_dir) / f"{config_name}.yaml", err, config_groups(Path(config_dir)))])
        groups = [o for o in overrides if o not in searchpath and "." not in o.split("=")[0]]
        bad, problems = [], []
        for override in sorted(overrides, key=lambda o: o not in groups):
            if override in searchpath:
                continue
            context = [] if override in groups else [g for g in groups if g not in bad]
            try:
                compose(config_name, overrides=searchpath + context + [override])
            except (HydraException, OmegaConfBaseException) as one:
                bad.append(override)
                problems.append(f"{override}: {error_message(one)}")
        try:
            cfg = compose(config_name, overrides=[o for o in overrides if o not in bad])
        except (HydraException, OmegaConfBaseException):  # overrides that only clash together
            refuse(problems or [error_message(failed)])
    groups = config_groups(Path(config_dir))  # the recipe folder's own groups too
    problems = [p + did_you_mean(cfg, o, groups) for p, o in zip(problems, bad)] or [error_message(failed)]
    return Composed(cfg, overrides, problems, implied_failures(problems, bad))


def sweep_jobs(argv: list[str], limit: int = MAX_SWEEP_CHECKS) -> list[tuple[list[str], str]]:
    """``(argv, its sweep values)`` of the first ``limit`` jobs a ``--multirun`` of ``argv`` (from
    `to_hydra_argv`) runs: the product of its sweep overrides (``optim.lr=1e-3,3e-4``,
    ``range(...)``) as Hydra's basic sweeper takes it, for `compose_overrides` to check each job's
    overrides before any job starts; [] when a sweep is not a list Hydra can enumerate (a sweeper
    plugin's intervals)."""
    config_dir, config_name, overrides = hydra_config(argv)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        choices = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [o.input_line]
            for o in parsed
        ]
    except (HydraException, ValueError, TypeError):
        return []
    head = ["--config-path", config_dir, "--config-name", config_name]
    swept = [len(c) > 1 for c in choices]
    return [
        ([*head, *job], " ".join(o for o, s in zip(job, swept) if s))
        for job in itertools.islice(itertools.product(*choices), limit)
    ]


def recipe_problem(path: Path, err: BaseException, groups: dict[str, list[str]] | None = None) -> str:
    """The problem of a recipe file that does not compose by itself, with the fix Hydra's message
    lacks: the bundled recipes for a defaults entry that names none, a group's options for an
    option that does not exist, the first lines of a YAML syntax error."""
    if isinstance(err, yaml.YAMLError):
        return f"{path} is not valid YAML: " + " ".join(str(err).split())
    message = error_message(err)
    if (missing := re.search(r"Could not (?:load|find) '([^']+)'", message)) is not None:
        group, _, option = missing.group(1).rpartition("/")
        options = (groups or config_groups()).get(group, []) if group else list(bundled_recipes())
        close = difflib.get_close_matches(option, options, n=1)
        named = f"the {group} options" if group else "the bundled recipes"
        message += f" ({f'did you mean {close[0]}? ' if close else ''}{named}: {', '.join(options)})"
    return f"{path}: {message}"


def implied_failures(problems: list[str], bad: list[str]) -> list[str]:
    """The problems of an alias's own field overrides (``plait kto`` adds ``data.unpaired=true``).
    Under a data group they do not fit (``data=stream``) the objective's check names the fix (use
    data=preference), so their "Could not override" is noise, left out unless nothing else is wrong."""
    implied = {o for _, alias_overrides, _ in ALIASES.values() for o in alias_overrides if "." in o.split("=")[0]}
    return [p for p, o in zip(problems, bad) if o in implied] if len(problems) == len(bad) else []


# Keys users bring for "my data file" to a recipe whose data reads named sources.
_FILE_KEYS = ("data.path", "data.file", "data.dataset", "data.train_file", "data.data_files", "data.dataset_path")


def own_data_fix(cfg: DictConfig, key: str, value: str, *, plain: bool = True) -> str | None:
    """The fix for a near miss at one's own data in a recipe whose data reads ``data.sources``
    (SFT, preference, prompt data): a file key (``data.path=mine.jsonl``, pretraining's), a field
    of a source the preset does not have (``data.sources.mine.source=...`` without ``+``), or a
    field a source's mapping does not set (``data.sources.mine.max_epochs=3`` without ``+``); None
    for any other key."""
    sources = OmegaConf.select(cfg, "data.sources")
    if not isinstance(sources, DictConfig):
        return None
    parts = key.split(".")
    if key in _FILE_KEYS:
        name, field = "mine", "source"
    elif len(parts) >= 4 and parts[:2] == ["data", "sources"] and parts[2] not in sources:
        name, field = parts[2], ".".join(parts[3:])
    elif (
        len(parts) == 4
        and parts[:2] == ["data", "sources"]
        and isinstance(sources[parts[2]], DictConfig)
        and parts[3] not in sources[parts[2]]
        and plain
    ):
        # A source given as a mapping (data.sources={mine: {source: ...}}) has only the fields it names.
        return f"data.sources.{parts[2]} sets no {parts[3]}: add it with +{key}={value}"
    else:
        return None
    preset = ", ".join(map(str, sources)) or "none"
    return (
        f"this data reads named sources (the preset's: {preset}); your file alone: "
        f"'data.sources={{{name}: {{{field}: {value}}}}}', or beside the preset's: +data.sources.{name}.{field}={value}"
    )


def target_taking(node: DictConfig, leaf: str) -> str | None:
    """The ``_target_`` of ``node`` when what it names takes an argument called ``leaf`` (by name,
    not through ``**kwargs``), else None (no target, or one that does not import)."""
    target = node.get("_target_")
    if not isinstance(target, str):
        return None
    try:
        params = inspect.signature(get_object(target)).parameters
    except Exception:  # a target that does not import or has no signature: its own check reports it
        return None
    named = params.get(leaf)
    return target if named is not None and named.kind is not named.VAR_KEYWORD else None


def did_you_mean(cfg: DictConfig, override: str, groups: dict[str, list[str]] | None = None) -> str:
    """The fix for an override of a key ``cfg`` lacks, the first found of: plait's name for a foreign
    option or a moved key (`trainer.foreign_names`); a key of the same node close in spelling
    (``model.max_seq_length``: model.max_seq_len); plait's name for the key's last part
    (``trainer.num_train_epochs``: not the loosely close trainer.limit_train_batches); a key of the
    node less close; the foreign name closest in spelling; in a node three parts deep or more, an
    argument of its ``_target_`` that the config does not list
    (``strategy.local_sgd.outer_optimizer.weight_decay``: add it with ``+``; last, as it imports the
    class), which a foreign name for the same name in another node (``optim.weight_decay``) gives way
    to; in a group's own node (``optim.amsgrad``), adding it with ``+`` if its class takes it, said
    without importing the class. `` (unknown key)`` when none is. A group
    option added with ``+`` where the recipe already picks one (``+budget=msft`` on sft) says to drop the ``+``."""
    key, _, value = override.partition("=")
    plain = not key.startswith(("+", "~"))  # an override that sets a key as it is (not adds or deletes one)
    key = key.lstrip("+~")
    options = (groups or config_groups()).get(key)
    if options is not None and override.startswith("+") and value in options:  # +model=nano: Multiple values
        return f" (the recipe already picks a {key}; to choose another, {key}={value} without the '+')"
    if options is not None and value not in options:  # a group's option (model=tiney)
        close = difflib.get_close_matches(value, options, n=1)
        return f" ({f'did you mean {key}={close[0]}? ' if close else ''}the {key} options: {', '.join(options)})"
    if (fix := own_data_fix(cfg, key, value, plain=plain and bool(value))) is not None:
        return f" ({fix})"
    if (plait := plait_override(key, value, by_last_part=False)) is not None:
        return f" (unknown key; use {plait})"
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return ""
    keys, prefix = [str(k) for k in node], parent + "." if parent else ""
    if match := difflib.get_close_matches(leaf, keys, n=1, cutoff=CLOSE):
        return f" (unknown key; did you mean {prefix}{match[0]}?)"

    # A foreign name that only moves the same name to another node (optim.weight_decay for an outer
    # optimizer's weight_decay) gives way to the node's own class taking it, checked last.
    def moves(plait: str) -> bool:
        return "_target_" in node and plait.partition("=")[0].rpartition(".")[2] == leaf

    moved = None
    if (plait := plait_override(key, value)) is not None:
        if not moves(plait):
            return f" (unknown key; use {plait})"
        moved = plait
    if moved is None:
        if match := difflib.get_close_matches(leaf, keys, n=1):
            return f" (unknown key; did you mean {prefix}{match[0]}?)"
        near = difflib.get_close_matches(leaf, list(FOREIGN_NAMES), n=1, cutoff=CLOSE)
        if near and (plait := plait_override(near[0], value)) is not None and plait.partition("=")[0] != key:
            if not moves(plait):
                return f" (unknown key; did you mean {plait}?)"
            moved = plait
    # A setting the class takes but the config does not list, for a node inside a group's (a plugin's,
    # its optimizer's: three parts or more): the check imports the class, and torch with it, which a
    # typo in a group itself (optim.zzz) must not wait for.
    if key.count(".") >= 2 and (target := target_taking(node, leaf)) is not None:
        return f" (a setting of {target} that the config does not list; add it with +{key}={value})"
    if moved:
        return f" (unknown key; use {moved})"
    if key.count(".") < 2 and isinstance(target := node.get("_target_"), str):  # said, not checked: no import
        return f" (unknown key; if {target} takes {leaf}, add it with +{key}={value})"
    return " (unknown key)"
