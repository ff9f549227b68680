"""The train command's checks before Hydra starts a job: compose the recipe with every bad
override reported at once, then check the launch (`trainer.run.check_launch`); and the job itself
(`run_job`). `trainer.train` (the command) calls these; they import the whole trainer
(Lightning), which ``plait RECIPE --cfg job`` never needs.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from strategies.checkpoint.dcp import CheckpointError
from strategies.mesh import MOVED_KEYS
from trainer.catalog import ALIASES, fail
from trainer.compose import adopt_run_model, error_message, hydra_config
from trainer.config import ConfigError
from trainer.init_from import take_run_model
from trainer.run import Launch, check_launch, run
from trainer.targets import UntrustedTargetError


def run_job(cfg: DictConfig, overrides: Sequence[str], launch: Launch | None) -> None:
    """One Hydra job of the train command: `trainer.run.run` of ``cfg`` with a plait run's model
    adopted (`adopt_run_model`); ``launch`` as checked by `preflight` (None: checked in the job)."""
    run(adopt_run_model(cfg, overrides), launch)


def preflight(argv: list[str]) -> Launch | None:
    """Composes and checks the config before Hydra creates a run directory (`trainer.run.check_launch`);
    exits 2 on problems (every config problem listed; a damaged checkpoint to resume from on one
    line). Returns what it checked, for `trainer.run.run`."""
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


def _implied_failures(problems: list[str], bad: list[str]) -> list[str]:
    """The problems of an alias's own field overrides (``plait kto`` adds ``data.unpaired=true``).
    Under a data group they do not fit (``data=stream``) the objective's check names the fix (use
    data=preference), so their "Could not override" is noise, left out unless nothing else is wrong."""
    implied = {o for _, alias_overrides, _ in ALIASES.values() for o in alias_overrides if "." in o.split("=")[0]}
    return [p for p, o in zip(problems, bad) if o in implied] if len(problems) == len(bad) else []


def _did_you_mean(cfg: DictConfig, override: str) -> str:
    """`` (unknown key; did you mean train.micro_batch_size?)`` for an override of a key ``cfg`` lacks."""
    key = override.split("=", 1)[0].lstrip("+~")
    parent, _, leaf = key.rpartition(".")
    if parent == "strategy" and leaf in MOVED_KEYS:
        return f" (moved: use strategy.{MOVED_KEYS[leaf]}={override.partition('=')[2]})"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return ""
    match = difflib.get_close_matches(leaf, [str(k) for k in node], n=1)
    return f" (unknown key; did you mean {parent + '.' if parent else ''}{match[0]}?)" if match else " (unknown key)"
