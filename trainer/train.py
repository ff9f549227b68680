"""``plait [train] [RECIPE] overrides``: the train command (the default of the command table).

Flow, top to bottom: RECIPE -> Hydra's own flags (so the argv that Lightning re-runs in child
processes is self-describing) -> compose, refusing every override that does not apply before the
trainer loads (`trainer.overrides`, Hydra only) -> validate before anything is launched or written
(`trainer.preflight`) -> Hydra runs `trainer.run.run`, which prepares data, builds everything (trainer/build.py) and fits.

``plait RECIPE --help`` prints the recipe's config groups (the option it picks and the others)
and its composed config; Hydra's other flags (``--cfg job``, ``--info``, ``--multirun``, ...)
go to Hydra as they are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.catalog import HELP_FLAGS, bundled_recipes, config_groups, fail
from trainer.compose import (
    adopt_run_model,
    drop_null_sources,
    error_message,
    hydra_config,
    register_resolvers,
    to_hydra_argv,
)
from trainer.finetune_defaults import lr_line
from trainer.overrides import compose_overrides, sweep_jobs

# trainer.preflight imports the whole trainer (Lightning, ~5 s): imported where a launch needs it,
# so that plait RECIPE --cfg job (and Hydra's other info flags) answer at once.

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
        composed = compose_overrides(argv)
        composed.refuse_typed()  # a mistyped override answers at once, before the trainer loads
        from trainer.preflight import preflight  # lazy: the whole trainer (see the imports above)

        launch = preflight(composed)
    elif not launched_child and not any(a in _HYDRA_INFO for a in argv):  # a sweep: each job's config
        jobs = [(compose_overrides(job), values) for job, values in sweep_jobs(argv)]
        for composed, values in jobs:  # mistyped overrides first: answered before the trainer loads
            composed.refuse_typed(values)
        from trainer.preflight import preflight_sweep_job  # lazy: the whole trainer (see the imports above)

        for composed, values in jobs:
            preflight_sweep_job(composed, values)

    def hydra_task(cfg: DictConfig) -> None:
        from trainer.preflight import run_job  # lazy: the whole trainer (see the imports above)

        # Checked once per launch: by preflight here, else (children, sweeps) by run itself.
        run_job(cfg, HydraConfig.get().overrides.task, launch)

    hydra.main(version_base="1.3", config_path=None, config_name=None)(hydra_task)()


def print_recipe_help(argv: list[str]) -> None:
    """The recipe's config groups (chosen option first) and its composed config, for ``--help``."""
    config_dir, config_name, overrides = hydra_config([a for a in argv if a not in HELP_FLAGS])
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        fail(error_message(err))
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    cfg = adopt_run_model(drop_null_sources(cfg), overrides)  # as a run composes it (a plait run as model.init_from)
    name = cfg.get("recipe", config_name)
    lines = [f"plait {name} [GROUP=OPTION] [FIELD=VALUE] ...   {bundled_recipes().get(name, '')}".rstrip(), ""]
    lines += ["Config groups (GROUP=OPTION; * = this recipe's choice):"]
    for group, options in config_groups(Path(config_dir)).items():  # a recipe file's folder's own groups too
        chosen = choices.get(group)
        shown = [f"*{o}" if o == chosen else o for o in options]
        lines.append(f"  {group:<12} {', '.join(shown)}" + ("" if chosen in options else "  (none chosen)"))
    lines += ["", "Composed config (every field is an override, e.g. optim.lr=1e-3):", OmegaConf.to_yaml(cfg).rstrip()]
    if (lr := lr_line(cfg)) is not None:  # ${plait.lr:...} above: the rate this command line gets
        lines += ["", lr]
    print("\n".join(lines))
