"""``plait [train] [RECIPE] overrides``: the train command (the default of the command table).

Flow, top to bottom: RECIPE -> Hydra's own flags (so the argv that Lightning re-runs in child
processes is self-describing) -> compose and validate before anything is launched or written ->
Hydra runs `trainer.run.run`, which prepares data, builds everything (trainer/build.py) and fits.

``plait RECIPE --help`` prints the recipe's config groups (the option it picks and the others)
and its composed config; Hydra's other flags (``--cfg job``, ``--info``, ``--multirun``, ...)
go to Hydra as they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from trainer.compose import (
    ALIASES,
    HELP_FLAGS,
    bundled_recipes,
    config_groups,
    error_message,
    fail,
    hydra_config,
    register_resolvers,
    to_hydra_argv,
)

if TYPE_CHECKING:
    from trainer.run import Launch

_MULTIRUN = ("-m", "--multirun")
_HYDRA_INFO = ("--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--shell-completion", "-sc")


def main(argv: list[str]) -> None:
    """Runs ``plait [RECIPE] overrides`` (or a child process's Hydra argv) as a Hydra job."""
    argv = to_hydra_argv(argv)
    register_resolvers()
    if any(a in HELP_FLAGS for a in argv):
        return print_recipe_help(argv)
    sys.argv = [sys.argv[0]] + argv
    launched_child = "LOCAL_RANK" in os.environ and os.environ.get("LOCAL_RANK") != "0"
    launch = None
    if not launched_child and not any(a in _MULTIRUN + _HYDRA_INFO for a in argv):
        launch = preflight(argv)

    import hydra

    def hydra_task(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        from trainer.run import run

        # Checked once per launch: by preflight here, else (children, sweeps) by run itself.
        run(adopt_run_model(cfg, HydraConfig.get().overrides.task), launch)

    hydra.main(version_base="1.3", config_path=None, config_name=None)(hydra_task)()


def print_recipe_help(argv: list[str]) -> None:
    """The recipe's config groups (chosen option first) and its composed config, for ``--help``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    config_dir, config_name, overrides = hydra_config([a for a in argv if a not in HELP_FLAGS])
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        fail(error_message(err))
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    cfg = adopt_run_model(cfg, overrides)  # a plait run as model.init_from: its model node, as a run composes it
    name = cfg.get("recipe", config_name)
    lines = [f"plait {name} [GROUP=OPTION] [FIELD=VALUE] ...   {bundled_recipes().get(name, '')}".rstrip(), ""]
    lines += ["Config groups (GROUP=OPTION; * = this recipe's choice):"]
    for group, options in config_groups().items():
        chosen = choices.get(group)
        shown = [f"*{o}" if o == chosen else o for o in options]
        lines.append(f"  {group:<12} {', '.join(shown)}" + ("" if chosen in options else "  (none chosen)"))
    lines += ["", "Composed config (every field is an override, e.g. optim.lr=1e-3):", OmegaConf.to_yaml(cfg).rstrip()]
    print("\n".join(lines))


def preflight(argv: list[str]) -> Launch | None:
    """Composes and checks the config before Hydra creates a run directory (`trainer.run.check_launch`);
    exits 2 on problems (every config problem listed; a damaged checkpoint to resume from on one
    line). Returns what it checked, for `trainer.run.run`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from strategies.checkpoint import CheckpointError
    from trainer.config import ConfigError
    from trainer.models.init_from import take_run_model
    from trainer.run import check_launch
    from trainer.targets import UntrustedTargetError

    config_dir, config_name, overrides = hydra_config(argv)
    problems: list[str] = []
    implied: list[str] = []  # problems of an alias's own overrides (see `_implied_failures`)
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as err:
            # Report every bad override, not just the first one Hydra stops at, then validate the rest.
            # A field override is tried under the group choices that compose (data=stream data.path=x:
            # the path is stream's), so the override named is the one at fault.
            searchpath = [o for o in overrides if o.startswith("hydra.searchpath")]
            bad = []
            groups = [o for o in overrides if o not in searchpath and "." not in o.split("=")[0]]
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
                fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems or [error_message(err)]))
            problems = [p + _did_you_mean(cfg, o) for p, o in zip(problems, bad)] or [error_message(err)]
            implied = _implied_failures(problems, bad)
    launch = None
    try:
        cfg = take_run_model(cfg, overrides)  # a plait run as model.init_from: its architecture
        launch = check_launch(cfg)
    except UntrustedTargetError as err:  # nothing of that run's model is built or validated
        problems.append(str(err))
    except ConfigError as err:
        problems += err.problems
    except CheckpointError as err:  # a damaged checkpoint to resume from: one line unless overrides failed too
        if not problems:
            fail(str(err))
        problems.append(str(err))
    if len(implied) < len(problems):
        problems = [p for p in problems if p not in implied]
    if problems:
        fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    return launch


def adopt_run_model(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """`trainer.models.init_from.take_run_model`, its refusal of a run's model as one
    ``plait: error:`` line (exit 2) where preflight has not checked it (children, sweeps, --help)."""
    from trainer.models.init_from import take_run_model
    from trainer.targets import UntrustedTargetError

    try:
        return take_run_model(cfg, overrides)
    except UntrustedTargetError as err:
        fail(str(err))


def _implied_failures(problems: list[str], bad: list[str]) -> list[str]:
    """The problems of an alias's own field overrides (``plait kto`` adds ``data.unpaired=true``).
    Under a data group they do not fit (``data=stream``) the objective's check names the fix (use
    data=preference), so their "Could not override" is noise, left out unless nothing else is wrong."""
    implied = {o for _, alias_overrides, _ in ALIASES.values() for o in alias_overrides if "." in o.split("=")[0]}
    return [p for p, o in zip(problems, bad) if o in implied] if len(problems) == len(bad) else []


def _did_you_mean(cfg: DictConfig, override: str) -> str:
    """`` (unknown key; did you mean train.micro_batch_size?)`` for an override of a key ``cfg`` lacks."""
    import difflib

    from omegaconf import OmegaConf

    from strategies.mesh import MOVED_KEYS  # only on a bad override: the strategy's renamed keys

    key = override.split("=", 1)[0].lstrip("+~")
    parent, _, leaf = key.rpartition(".")
    if parent == "strategy" and leaf in MOVED_KEYS:
        return f" (moved: use strategy.{MOVED_KEYS[leaf]}={override.partition('=')[2]})"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return ""
    match = difflib.get_close_matches(leaf, [str(k) for k in node], n=1)
    return f" (unknown key; did you mean {parent + '.' if parent else ''}{match[0]}?)" if match else " (unknown key)"
