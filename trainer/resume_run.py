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

import difflib
import hashlib
import os
import shlex
import tempfile
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from trainer.catalog import CONF_DIR, bundled_recipes, config_groups, fail

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
    run that preset's layout: its mesh degrees, and the settings ``conf/strategy/PRESET.yaml`` itself
    makes, where the run's differ. What the run set beyond them (compile, precision, checkpointing,
    its ``strategy/lora``-like choices) stays, as a resume keeps everything not typed.

    A resumed run's config has no defaults list to pick a preset from; its fields are overrides like
    any other (DCP reshards to the new layout). A preset that turns a plugin node on or off or swaps its
    class (DiLoCo for IST) cannot be reached by a resume: the message names a new run instead.
    """
    from strategies.core.parallel_dims import MESH_AXES  # lazy: torch, for an error message only

    head = f"strategy={preset}: a resumed run keeps the options it was started with"
    folder, presets = CONF_DIR / "strategy", config_groups().get("strategy", [])
    if preset not in presets:
        close = difflib.get_close_matches(preset, presets, n=1)
        return (
            f"{head}; {f'did you mean strategy={close[0]}? ' if close else ''}the strategy options: "
            f"{', '.join(presets)}; a resume takes a preset's layout as its fields (e.g. strategy.dp_shard=2)"
        )
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):  # recipe_for refuses such a run first
        saved = {}
    run = saved.get("strategy") or {}
    base, own = (OmegaConf.to_container(OmegaConf.load(folder / f"{name}.yaml")) for name in ("nd", preset))
    base.pop("defaults", None)
    own.pop("defaults", None)
    subgroups = {k for k in {**base, **own} if (folder / k).is_dir()}  # strategy/lora, ...: the run's own choices
    fields = [
        f"strategy.{axis}={want}"
        for axis in MESH_AXES
        if axis in run and run[axis] != (want := own.get(axis, base.get(axis)))
    ]
    more, nodes = _differences(
        {k: v for k, v in own.items() if k not in MESH_AXES and k not in subgroups}, run, "strategy"
    )
    fields += more
    nodes += [  # a plugin the run has on and the preset leaves off (nd's null): local SGD, fault tolerance
        f"strategy.{k}"
        for k, v in base.items()
        if v is None and k not in own and k not in subgroups and isinstance(run.get(k), dict)
    ]
    recipe = saved.get("recipe") if saved.get("recipe") in bundled_recipes() else "RECIPE"
    if nodes:
        return (
            f"{head}, and {preset} differs from it in {', '.join(nodes)}, which a resume cannot change; start a new "
            f"run from this one: " + shlex.join(["plait", recipe, f"strategy={preset}", f"model.init_from={run_dir}"])
        )
    if not fields:
        return f"{head}; it already has {preset}'s layout: " + shlex.join(["plait", "resume", str(run_dir), *others])
    return f"{head}; {preset}'s layout is these fields (DCP reshards): " + shlex.join(
        ["plait", "resume", str(run_dir), *fields, *others]
    )


def _differences(wanted: dict, run: dict, prefix: str) -> tuple[list[str], list[str]]:
    """The overrides (``prefix.key=value``) that give ``run`` the plain values of ``wanted``, and the
    nodes one of them has and the other has not (or null), or of another class (``_target_``).
    Interpolations (``${...}``) and keys ``run`` lacks (a config saved before the key existed) are skipped."""
    fields, nodes = [], []
    for key, value in wanted.items():
        have, path = run.get(key), f"{prefix}.{key}"
        if isinstance(value, dict) and isinstance(have, dict):
            if "_target_" in value and value["_target_"] != have.get("_target_"):
                nodes.append(path)
                continue
            more = _differences(value, have, path)
            fields, nodes = fields + more[0], nodes + more[1]
        elif isinstance(value, dict) or isinstance(have, dict):
            nodes.append(path)
        elif key in run and not (isinstance(value, str) and "${" in value) and have != value:
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
        chosen = [o for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+~") == "strategy"]
        if picked == ["strategy"] and len(chosen) == 1:
            others = [o for o in overrides if o not in chosen]
            fail(preset_fields_fix(run_dir, chosen[0].split("=", 1)[1], others))
        fail(
            f"{', '.join(picked)}: a resumed run keeps the options it was started with; change one of their "
            f"fields (e.g. strategy.dp_shard=2), or start a new run from this one with model.init_from={run_dir}"
        )
    recipe = recipe_for(run_dir)
    from trainer.train import main as train  # lazy: Hydra and the trainer's entry

    train([str(recipe), f"run_dir={run_dir}", "resume=last", *overrides])
