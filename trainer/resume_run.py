"""``plait resume RUN_DIR [overrides]``: continue a run from its newest checkpoint with the config it was started with.

The run's ``config.yaml`` (every value it trained with, resolved) is the recipe: nothing typed at
the start has to be typed again. Overrides may change what keeps it the same run (more
``trainer.max_steps``, another checkpoint or evaluation interval, the layout: DCP reshards);
``optim.*``/``scheduler.*`` with ``resume_override=[...]``; what would make it another run (the
model, the objective, the data, the seed, the global batch) is refused before anything starts, with
the fix. Each change is said at launch and recorded in ``RUN_DIR/resumes.jsonl``; the continued run
writes to RUN_DIR, never to a new directory.

Invocations::

    plait resume runs/sft/2026-12-04_10-00-00                        # the same run, from its newest checkpoint
    plait resume runs/sft/2026-12-04_10-00-00 trainer.max_steps=2000 # train it longer
    plait resume runs/sft/... optim.lr=1e-4 resume_override=[optim.lr] # a new learning rate from this step on
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import yaml

from trainer.catalog import config_groups, fail

# The wrapper recipe: plait's base (Hydra's settings: the run writes to run_dir) under the run's values.
_HEADER = (
    "# plait resume: the run's config.yaml as a recipe (trainer/resume_run.py)\ndefaults:\n  - plait_base\n  - _self_\n"
)


def recipe_for(run_dir: Path) -> Path:
    """A recipe file holding ``run_dir``'s ``config.yaml``, named by its content (children of the
    launch compose it again, so it stays put: a temporary folder, one file per config).

    Raises:
        SystemExit: ``run_dir`` is not a plait run directory (no readable ``config.yaml``).
    """
    config = run_dir / "config.yaml"
    if not config.is_file():
        fail(
            f"{run_dir} is not a plait run directory (no config.yaml: a run writes it once training starts); "
            f"name a run's directory, e.g. plait resume runs/<recipe>/<time>"
        )
    text = config.read_text(encoding="utf-8")
    try:
        recipe = (yaml.safe_load(text) or {}).get("recipe") or "run"
    except yaml.YAMLError as err:
        fail(f"{config} does not parse ({err}); it is not a config plait wrote")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"plait-resume-{os.getuid()}" / digest  # this user's own folder
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{recipe}.yaml"
    if not path.is_file() or path.read_text(encoding="utf-8") != _HEADER + text:
        path.write_text(_HEADER + text, encoding="utf-8")
    return path


def group_overrides(overrides: list[str]) -> list[str]:
    """The overrides that pick a config group's option (``model=nano``, ``strategy/lora=default``):
    a resumed run's config has no defaults list to pick from."""
    groups = set(config_groups())
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    return [k for k in keys if "/" in k or k in groups]


def main(argv: list[str]) -> None:
    """Continues the run directory ``argv[0]`` with the overrides after it (module docstring)."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        fail("plait resume needs a run directory first: plait resume RUN_DIR [overrides]")
    run_dir, overrides = Path(argv[0]).expanduser(), argv[1:]
    if any(a in ("-m", "--multirun") for a in overrides):
        fail("plait resume continues one run; a sweep (--multirun) starts new runs: plait RECIPE --multirun ...")
    if picked := group_overrides(overrides):
        fail(
            f"{', '.join(picked)}: a resumed run keeps the options it was started with; change one of their "
            f"fields (e.g. strategy.dp_shard=2), or start a new run from this one with model.init_from={run_dir}"
        )
    recipe = recipe_for(run_dir)
    from trainer.train import main as train  # lazy: Hydra and the trainer's entry

    train([str(recipe), f"run_dir={run_dir}", "resume=last", *overrides])
