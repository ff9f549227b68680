"""plait: train LLMs with Lightning + Hydra. ``plait [RECIPE] [hydra overrides]``.

Invocations::

    plait                                             # pretrain recipe, CPU, bundled corpus
    plait pretrain trainer.devices=2                  # 2 processes (gloo on CPU)
    plait pretrain trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed
    torchrun --nproc-per-node 8 -m trainer.cli pretrain trainer.devices=8   # processes started by torchrun
    plait my_recipes/long.yaml trainer.max_steps=2000 # a recipe file of your own
    plait pretrain --multirun optim.lr=1e-3,3e-4      # Hydra sweep, one run directory per job
    plait generate ckpt=runs/pretrain prompt="To be"  # sample from the newest checkpoint
    plait plan model=llama3_8b cluster=h100x8 data.seq_len=8192   # ranked layouts, no training
    plait merge base=runs/base deltas=[runs/sft,runs/dpo] method=ties   # PAFT merge of fine-tuned deltas
    plait export ckpt=runs/sft out=exports/sft        # a checkpoint as a Hugging Face directory
    plait sft model=hf model.init_from=/models/Qwen3-0.6B  # start from a Hugging Face checkpoint

Flow, top to bottom: RECIPE -> Hydra's own flags (so the argv that Lightning re-runs in child
processes is self-describing) -> compose and validate before anything is launched or written ->
Hydra runs `run`, which prepares data, builds everything (trainer/build.py) and fits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from omegaconf import DictConfig

_MULTIRUN = ("-m", "--multirun")
_HYDRA_INFO = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--shell-completion", "-sc")


def _package_dir(name: str) -> Path:
    # Installed: trainer.conf / trainer.recipes are packages. From a source tree on sys.path: repo dirs.
    try:
        return Path(str(files(f"trainer.{name}")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / name


CONF_DIR = _package_dir("conf")
RECIPES_DIR = _package_dir("recipes")


def bundled_recipes() -> dict[str, str]:
    """Recipe name -> its first comment line."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.stat().st_size else ""
        out[path.stem] = first.lstrip("# ").strip()
    return out


def to_hydra_argv(argv: list[str]) -> list[str]:
    """``[RECIPE] overrides`` -> ``--config-path DIR --config-name NAME overrides hydra.searchpath=[...]``.

    Idempotent: an argv that already names its config (a child process) is returned unchanged.

    Raises:
        SystemExit: RECIPE is neither a bundled recipe nor an existing YAML file.
    """
    if any(a.startswith(("--config-name", "-cn")) for a in argv):
        return argv
    recipe, rest = "pretrain", argv
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        recipe, rest = argv[0], argv[1:]
    if recipe.endswith((".yaml", ".yml")) or os.sep in recipe:
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            _fail(f"recipe file {recipe} does not exist")
        config = ["--config-path", str(path.parent), "--config-name", path.stem]
    else:
        if recipe not in bundled_recipes():
            _fail(f"unknown recipe {recipe!r}; bundled recipes: {', '.join(bundled_recipes())}, or a path to a .yaml file")
        config = ["--config-path", str(RECIPES_DIR), "--config-name", recipe]
    search = f"hydra.searchpath=['file://{CONF_DIR}','file://{RECIPES_DIR}']"
    return config + rest + [search]


def compose(recipe: str = "pretrain", overrides: Sequence[str] = ()) -> DictConfig:
    """The config the CLI would compose for ``plait RECIPE overrides``, without starting a Hydra job.

    For scripts and tests that build and fit in-process (``trainer.build.build_run``). The config
    is not validated (``trainer.config.validate`` does that).

    Args:
        recipe: a bundled recipe name or the path of a recipe .yaml file.
        overrides: Hydra overrides, e.g. ``["model=nano", "trainer.max_steps=10"]``.

    Raises:
        SystemExit: RECIPE is neither a bundled recipe nor an existing YAML file.
        hydra.errors.HydraException: an override does not apply.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    argv = to_hydra_argv([recipe, *overrides])
    config_dir, config_name = argv[argv.index("--config-path") + 1], argv[argv.index("--config-name") + 1]
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return hydra_compose(config_name, overrides=argv[argv.index("--config-name") + 2 :])


def _fail(message: str, code: int = 2) -> None:
    print(f"plait: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def print_help() -> None:
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in sorted(CONF_DIR.iterdir()) if p.is_dir() and not p.name.startswith("_")}
    lines = [__doc__.split("\n\nFlow")[0], "", "Recipes (plait RECIPE):"]
    lines += [f"  {name:<12} {text}" for name, text in bundled_recipes().items()]
    lines += ["", "Config groups (GROUP=OPTION), every field is also an override (e.g. optim.lr=1e-3):"]
    lines += [f"  {name:<12} {', '.join(options)}" for name, options in groups.items()]
    lines += ["", "plait RECIPE --help shows the composed config of a recipe; --cfg job prints it."]
    print("\n".join(lines))


def preflight(argv: list[str]) -> None:
    """Composes and validates the config before Hydra creates a run directory; exits 2 on problems."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from trainer.config import ConfigError, validate
    from trainer.run import check_run_dir

    config_dir, config_name = argv[argv.index("--config-path") + 1], argv[argv.index("--config-name") + 1]
    overrides = [a for a in argv if not a.startswith("-") and a not in (config_dir, config_name)]
    problems: list[str] = []
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as err:
            # Report every bad override, not just the first one Hydra stops at, then validate the rest.
            searchpath = [o for o in overrides if o.startswith("hydra.searchpath")]
            bad = []
            for override in overrides:
                if override in searchpath:
                    continue
                try:
                    compose(config_name, overrides=searchpath + [override])
                except (HydraException, OmegaConfBaseException) as one:
                    bad.append(override)
                    problems.append(f"{override}: {_message(one)}")
            try:
                cfg = compose(config_name, overrides=[o for o in overrides if o not in bad])
            except (HydraException, OmegaConfBaseException):  # overrides that only clash together
                _fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems or [_message(err)]))
            problems = [p + _did_you_mean(cfg, o) for p, o in zip(problems, bad)] or [_message(err)]
    try:
        validate(cfg)
        check_run_dir(cfg)
    except ConfigError as err:
        problems += err.problems
    if problems:
        _fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _did_you_mean(cfg: DictConfig, override: str) -> str:
    """`` (unknown key; did you mean train.micro_batch_size?)`` for an override of a key ``cfg`` lacks."""
    import difflib

    from omegaconf import OmegaConf

    key = override.split("=", 1)[0].lstrip("+~")
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf in node:
        return ""
    match = difflib.get_close_matches(leaf, [str(k) for k in node], n=1)
    return f" (unknown key; did you mean {parent + '.' if parent else ''}{match[0]}?)" if match else " (unknown key)"


def _message(err: BaseException) -> str:
    """First line of the most specific message in an exception chain (Hydra often wraps an empty one)."""
    while not str(err).strip() and err.__cause__ is not None:
        err = err.__cause__
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``plait``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "generate":
        from trainer.generate import main as generate_main

        return generate_main(argv[1:])
    if argv and argv[0] == "export":
        from trainer.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "merge":
        from trainer.merge import main as merge_main

        return merge_main(argv[1:])
    if argv and argv[0] == "plan":
        from trainer.plan import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        return print_help()
    argv = to_hydra_argv(argv)
    sys.argv = [sys.argv[0]] + argv
    launched_child = "LOCAL_RANK" in os.environ and os.environ.get("LOCAL_RANK") != "0"
    if not launched_child and not any(a in _MULTIRUN + _HYDRA_INFO for a in argv):
        preflight(argv)

    import hydra

    hydra.main(version_base="1.3", config_path=None, config_name=None)(_hydra_task)()


def _hydra_task(cfg: DictConfig) -> None:
    from trainer.run import run

    run(cfg)


if __name__ == "__main__":
    main()

