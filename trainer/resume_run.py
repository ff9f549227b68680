"""``plait resume RUN_DIR [overrides]``: continue a run from its newest checkpoint with the config it was started with.

The run's ``config.yaml`` (every value it trained with, resolved) is the recipe: nothing typed at
the start has to be typed again. Overrides may change what keeps it the same run (more
``trainer.max_steps``, another checkpoint or evaluation interval, the layout: DCP reshards, given as
fields: ``strategy=tp`` is refused with the fields that make tp's layout);
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

from trainer.catalog import CONF_DIR, config_groups, fail

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


def preset_fields_fix(run_dir: Path, preset: str, others: list[str]) -> str:
    """The refusal of ``plait resume RUN strategy=PRESET``, naming the field overrides that give the
    run that preset's layout: the plain settings of ``conf/strategy/PRESET.yaml`` over ``nd.yaml``
    where the run's differ (its own ``strategy/lora``-like choices stay).

    A resumed run's config has no defaults list to pick a preset from; its fields are overrides like
    any other (DCP reshards to the new layout). A preset that turns a plugin node on or off (local
    SGD, fault tolerance) cannot be reached by a resume: the message says to start a new run instead.
    """
    from omegaconf import OmegaConf

    head = f"strategy={preset}: a resumed run keeps the options it was started with"
    folder = CONF_DIR / "strategy"
    try:
        run = (yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}).get("strategy") or {}
        layers = [OmegaConf.load(folder / "nd.yaml"), OmegaConf.load(folder / f"{preset}.yaml")]
    except (OSError, yaml.YAMLError):  # an unknown preset or an unreadable run: the general fix
        return (
            f"{head}; change its fields (e.g. strategy.dp_shard=2), or start a new run from this one with "
            f"model.init_from={run_dir}"
        )
    for layer in layers:
        layer.pop("defaults", None)
    wanted = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=False)
    for group in [k for k in wanted if (folder / k).is_dir()]:  # strategy/lora, ...: the run's own choices stay
        del wanted[group]
    fields, nodes = _differences(wanted, run, "strategy")
    nodes += [
        f"strategy.{k}" for k, v in run.items() if isinstance(v, dict) and k not in wanted and not (folder / k).is_dir()
    ]
    if nodes:
        return (
            f"{head}, and {preset} differs from it in {', '.join(nodes)}, which a resume cannot change; start a new "
            f"run from this one: plait RECIPE strategy={preset} model.init_from={run_dir}"
        )
    if not fields:
        return f"{head}; it already trains with {preset}'s settings: plait resume {' '.join([str(run_dir), *others])}"
    return f"{head}; {preset}'s layout is these fields (DCP reshards): plait resume " + " ".join(
        [str(run_dir), *fields, *others]
    )


def _differences(wanted: dict, run: dict, prefix: str) -> tuple[list[str], list[str]]:
    """The overrides (``prefix.key=value``) that give ``run`` the plain values of ``wanted``, and the
    nodes one of them has and the other has not (or null); interpolations (``${...}``) are skipped."""
    fields, nodes = [], []
    for key, value in wanted.items():
        have, path = run.get(key), f"{prefix}.{key}"
        if isinstance(value, dict) and isinstance(have, dict):
            more = _differences(value, have, path)
            fields, nodes = fields + more[0], nodes + more[1]
        elif isinstance(value, dict) or isinstance(have, dict):
            nodes.append(path)
        elif not (isinstance(value, str) and "${" in value) and have != value:
            fields.append(f"{path}={_override_value(value)}")
    return fields, nodes


def _override_value(value: object) -> str:
    """``value`` as a Hydra override writes it (null, true, [1,2], 1e-05, text)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def main(argv: list[str]) -> None:
    """Continues the run directory ``argv[0]`` with the overrides after it (module docstring)."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        fail("plait resume needs a run directory first: plait resume RUN_DIR [overrides]")
    run_dir, overrides = Path(argv[0]).expanduser(), argv[1:]
    if any(a in ("-m", "--multirun") for a in overrides):
        fail("plait resume continues one run; a sweep (--multirun) starts new runs: plait RECIPE --multirun ...")
    if picked := group_overrides(overrides):
        presets = [o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")]
        if picked == ["strategy"] and len(presets) == 1:
            fail(preset_fields_fix(run_dir, presets[0], [o for o in overrides if not o.startswith("strategy=")]))
        fail(
            f"{', '.join(picked)}: a resumed run keeps the options it was started with; change one of their "
            f"fields (e.g. strategy.dp_shard=2), or start a new run from this one with model.init_from={run_dir}"
        )
    recipe = recipe_for(run_dir)
    from trainer.train import main as train  # lazy: Hydra and the trainer's entry

    train([str(recipe), f"run_dir={run_dir}", "resume=last", *overrides])
