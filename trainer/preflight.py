"""The train command's checks before Hydra starts a job, once its overrides apply
(`trainer.overrides`, which refuses the user's mistyped ones before this module loads): the
launch (`trainer.run.check_launch`: validate, the run directory, the resume), with the problems
of an alias's own overrides; and the job itself (`run_job`). `trainer.train` (the command) calls
these; they import the whole trainer (Lightning), which ``plait RECIPE --cfg job`` never needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from strategies.checkpoint.dcp import CheckpointError
from trainer.catalog import fail
from trainer.compose import adopt_run_model, drop_null_sources
from trainer.config import ConfigError, validate
from trainer.data.config_paths import absolute_paths
from trainer.init_from import take_run_model
from trainer.overrides import Composed, refuse
from trainer.run import Launch, check_launch, run
from trainer.targets import UntrustedTargetError


def run_job(cfg: DictConfig, overrides: Sequence[str], launch: Launch | None) -> None:
    """One Hydra job of the train command: `trainer.run.run` of ``cfg`` with a plait run's model
    adopted (`adopt_run_model`) and its data paths absolute (`trainer.data.config_paths.absolute_paths`, as
    `preflight` checked them); ``launch`` as checked by `preflight` (None: checked in the job)."""
    run(absolute_paths(adopt_run_model(drop_null_sources(cfg), overrides)), launch)


def _as_checked(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``cfg`` as a launch checks it: null sources dropped, a plait run as ``model.init_from`` giving
    its model (`take_run_model`), data paths absolute."""
    return absolute_paths(take_run_model(drop_null_sources(cfg), overrides))


def preflight(composed: Composed) -> Launch | None:
    """Checks the composed config before Hydra creates a run directory (`trainer.run.check_launch`);
    exits 2 on problems (every config problem listed, with those of overrides that did not apply;
    a damaged checkpoint to resume from on one line). Returns what it checked, for `trainer.run.run`."""
    cfg, overrides, problems, implied = composed.cfg, composed.overrides, list(composed.problems), composed.implied
    launch = None
    try:
        cfg = _as_checked(cfg, overrides)
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
        refuse(problems)
    return launch


def preflight_sweep_job(composed: Composed, values: str) -> None:
    """Validates one ``--multirun`` job's composed config before the sweep starts (its run directory
    and resume are the job's own, checked when it runs): a bad value in the third job
    (``optim.lr=1e-3,abc``) is refused at once, naming the job, not after the first jobs trained.
    Exits 2 on problems (the job's mistyped overrides were refused before: `Composed.refuse_typed`).
    A config that reads Hydra's job (``seed=${hydra:job.num}``) resolves only inside it: checked when it starts."""
    if "${hydra:" in OmegaConf.to_yaml(composed.cfg, resolve=False):
        return
    try:
        validate(_as_checked(composed.cfg, composed.overrides))
    except UntrustedTargetError as err:
        refuse([f"{err} (in the sweep's job {values})"])
    except ConfigError as err:
        refuse([f"{p} (in the sweep's job {values})" for p in err.problems])
