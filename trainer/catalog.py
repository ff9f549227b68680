"""What plait ships, read without importing Hydra or torch: the ``conf/`` and ``recipes/`` folders,
the bundled recipes and their aliases, the config groups, the help flags and the ``plait: error:``
exit. `trainer.cli` and the command table (`trainer.commands`) need only these, so ``plait --help``
starts fast; composing a config is `trainer.compose`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import NoReturn

from strategies.runtime.terminal import write_line


def _package_dir(name: str) -> Path:
    # Installed: trainer.conf / trainer.recipes are packages. From a source tree on sys.path: repo dirs.
    try:
        return Path(str(files(f"trainer.{name}")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / name


CONF_DIR = _package_dir("conf")
RECIPES_DIR = _package_dir("recipes")
DEFAULT_RECIPE = "pretrain"
HELP_FLAGS = ("-h", "--help")

# alias -> (recipe, overrides it stands for, one-line description). The user's overrides come after.
ALIASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "dpo": ("preference", ("objective=dpo", "recipe=dpo"), "= plait preference objective=dpo: DPO's sigmoid loss against the initial policy"),
    "ipo": ("preference", ("objective=ipo", "recipe=ipo"), "= plait preference objective=ipo: squared loss on length-averaged log-ratios"),
    "simpo": ("preference", ("objective=simpo", "recipe=simpo"), "= plait preference objective=simpo: reference-free, length-normalised, target margin"),
    "orpo": ("preference", ("objective=orpo", "recipe=orpo"), "= plait preference objective=orpo: chosen NLL plus an odds-ratio term, no reference"),
    "kto": ("preference", ("objective=kto", "recipe=kto", "data.unpaired=true"), "= plait preference objective=kto data.unpaired=true: unpaired desirable/undesirable rows"),
}  # fmt: skip


def fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``plait: error: <message>`` to stderr (a line of its own) and exits with ``code`` (2: bad input)."""
    write_line(f"plait: error: {message}")
    raise SystemExit(code)


def say(line: str) -> None:
    """Prints ``plait: <line>`` on stderr at the start of a line of its own, also while training
    draws its progress bar (`strategies.runtime.terminal.write_line`)."""
    write_line(f"plait: {line}")


def bundled_recipes() -> dict[str, str]:
    """Recipe name -> its first comment line; aliases included (``dpo`` -> ``= plait preference ...``)."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.stat().st_size else ""
        out[path.stem] = first.lstrip("# ").strip()
    out.update({name: text for name, (_, _, text) in ALIASES.items()})
    return dict(sorted(out.items()))


def config_groups(*folders: Path) -> dict[str, list[str]]:
    """Config group -> its options (the YAML files of ``conf/<group>/``, and of ``<folder>/<group>/``
    for each of ``folders``: a recipe file's own folder, whose groups Hydra searches too)."""
    groups: dict[str, set[str]] = {}
    for root in (CONF_DIR, *folders):
        for p in sorted(root.iterdir()) if root.is_dir() else ():
            if p.is_dir() and not p.name.startswith("_") and any(p.glob("*.yaml")):
                groups.setdefault(p.name, set()).update(q.stem for q in p.glob("*.yaml"))
    return {name: sorted(options) for name, options in sorted(groups.items())}
