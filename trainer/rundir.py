"""A run directory's layout and the checkpoint a path names.

Every run (``plait RECIPE``; a ``plait merge`` output too) is one directory::

    config.yaml       the resolved config it trains with (rank 0 writes it at the start)
    tokenizer.json    its tokenizer (Hugging Face ``tokenizers`` format)
    tokenizer_config.json  its special tokens (eos, pad, and those its chat template reads)
    chat_template.jinja    the tokenizer's own chat template, when the run's data rendered with it
                      (or, without chat data, the tokenizer had one); absent: plait's default
    checkpoints/      step_0000100/ ... DCP checkpoints (strategies.checkpoint.dcp); ``last`` -> the newest;
                      superseded/after_step_<n>/step_*: those a resume from step n set aside
    metrics.csv       one row per logged step (trainer.loggers.RunCSVLogger, Lightning's CSV writer)
    summary.json      headline figures at the end (callbacks.summary)
    loss.png          train and validation loss curves (callbacks.plots)
    hf/               the model as a Hugging Face directory (callbacks.hf_export.at_end=true)

`RunDir` is the only place these names are spelled; `resolve_checkpoint` finds the checkpoint a
path names. The model of a run is `trainer.run_model.load_run_model`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.checkpoint.dcp import META_FILE, is_checkpoint, verify_checkpoint
from strategies.checkpoint.manifest import MANIFEST
from trainer.checkpoint_step import name_step

LAST = "last"
SUPERSEDED = "superseded"  # checkpoints/superseded/after_step_<n>/step_*: set aside by a resume from step n
RUN_DEPTH = 3  # how deep `resolve_checkpoint` looks for runs in a folder: runs/<recipe>/<time>/<job>
JOB_DIR_CHARS = 120  # the longest sweep job directory name (file systems allow 255 bytes)


def job_dirname(num: int, overrides: Sequence[str]) -> str:
    """The directory of job ``num`` of a ``--multirun`` sweep: ``job<num>`` and the values it
    sweeps, e.g. ``job1_optim.lr:0.0003_model:nano``.

    ``key:value`` pairs joined by ``_``: a path with ``=`` or ``,`` could not be given back in an
    override (``ckpt=...``, ``deltas=[...]``); any other character outside ``[A-Za-z0-9_.:+@-]``
    (``/``, brackets, spaces) is written ``%``.

    Args:
        overrides: the job's values of the swept keys (``key=value``), in the order typed.
    """
    pairs = [o.lstrip("+").replace("=", ":", 1) for o in overrides]  # +key=a,b names the key, as typed without +
    return re.sub(r"[^\w.:+@-]", "%", "_".join([f"job{num}", *pairs]))[:JOB_DIR_CHARS]


UNNAMED_KEYS = ("recipe", "run_dir", "logger")  # overrides a run's name leaves out: where it is and logs


def run_name(recipe: str, overrides: Sequence[str]) -> str:
    """A run's name for loggers that show runs side by side (wandb): the recipe and the user's
    overrides, e.g. ``pretrain model=nano optim.lr=3e-4`` (`UNNAMED_KEYS` dropped)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".", 1)[0] not in UNNAMED_KEYS]
    return " ".join([recipe, *kept])


def step_dir(root: Path, step: int) -> Path:
    """``root/step_<step, 7 digits>``: the directory of the checkpoint after optimizer step ``step``."""
    return Path(root) / f"step_{step:07d}"


def step_dirs(root: Path) -> list[Path]:
    """Every ``step_*`` directory in ``root``, complete or not, oldest first (``.tmp``/``.old``/``.pruned-``
    leftovers excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def step_checkpoints(root: Path) -> list[Path]:
    """The ``step_*`` checkpoints in ``root`` whose save finished (they have a manifest), oldest first."""
    return [p for p in step_dirs(root) if is_checkpoint(p)]


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory (see the module docstring); nothing is created or read here.

    Args:
        path: the run directory (``~`` expanded).
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir:
        """The run a checkpoint directory ``<run>/checkpoints/<step or last>`` belongs to (also one
        set aside in ``<run>/checkpoints/superseded/after_step_<n>/``)."""
        up = Path(checkpoint).parent.parent
        return cls(up.parent.parent if up.name == SUPERSEDED else up)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def tokenizer_config(self) -> Path:
        return self.path / "tokenizer_config.json"

    @property
    def chat_template(self) -> Path:
        return self.path / "chat_template.jinja"

    def tokenizer_files(self) -> tuple[Path, ...]:
        """The files that describe the run's tokenizer and chat template (copied together)."""
        return self.tokenizer, self.tokenizer_config, self.chat_template

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def last(self) -> Path:
        """``checkpoints/last``: a link to the newest step (a directory in a merged run)."""
        return self.checkpoints / LAST

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def loss_plot(self) -> Path:
        return self.path / "loss.png"

    @property
    def hf(self) -> Path:
        return self.path / "hf"

    def hf_step(self, step: int) -> Path:
        """``hf_step_<step>``: a Hugging Face export during training (callbacks.hf_export.every_n_steps)."""
        return self.path / f"hf_step_{step:07d}"

    def step(self, step: int) -> Path:
        """``checkpoints/step_<step>``."""
        return step_dir(self.checkpoints, step)

    def checkpoint(self, report: Callable[[str], None] | None = None) -> Path | None:
        """The newest intact checkpoint of this run, or None (see `resolve_checkpoint`)."""
        return resolve_checkpoint(self.checkpoints, report)

    def holds_checkpoints(self) -> bool:
        """Whether ``checkpoints/`` holds any ``step_*`` directory or ``last`` entry, intact or not
        (a fresh start into such a run is refused)."""
        return bool(step_dirs(self.checkpoints)) or self.last.is_symlink() or self.last.exists()

    def write_config(
        self,
        cfg: DictConfig,
        tokenizer: Any,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Writes ``config.yaml`` (resolved: no interpolation left), ``tokenizer.json``, its
        ``tokenizer_config.json`` and ``chat_template.jinja`` as transformers lays them out, so the
        run's tokenizer and template read back as they were trained (a later run from this one,
        ``plait export``, ``plait chat``).

        Args:
            tokenizer: a ``trainer.data.tokenizer.Tokenizer`` (its ``eos_token`` and ``pad_token`` are written).
            special_tokens: the special tokens the chat template renders with (over the tokenizer's).
            chat_template: the tokenizer's own template the run used; None removes a recorded one
                (the run uses plait's default).
        """
        OmegaConf.save(cfg, self.config, resolve=True)
        tokenizer.save(str(self.tokenizer))
        special = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
        special.update({key: value for key, value in (special_tokens or {}).items() if value})
        self.tokenizer_config.write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
        if chat_template is None:
            self.chat_template.unlink(missing_ok=True)
        else:
            self.chat_template.write_text(chat_template, encoding="utf-8")

    def load_config(self) -> DictConfig:
        return OmegaConf.load(self.config)


def last_link_problem(root: Path) -> str | None:
    """Why ``root/last`` cannot be moved to the next checkpoint of a run, or None.

    A training run's ``last`` is a symbolic link that each save replaces atomically; a directory
    there (a merge's output, a copy made by hand) cannot be replaced by a link, and a regular
    file would be lost. Nothing is changed here.
    """
    last = Path(root) / LAST
    if last.is_symlink() or not last.exists():
        return None
    kind = "a directory" if last.is_dir() else "a file"
    return (
        f"{last} is {kind}, not the link plait moves to each new checkpoint (a merge's output or a copy?); "
        f"move it out of {last.parent} (mv {last} {last.parent.parent / 'last.moved'}) and resume again "
        f"(from the newest step_* checkpoint), or train from it in a new run_dir with model.init_from={last}"
    )


def _candidates(root: Path) -> list[Path]:
    """The checkpoints of one ``checkpoints/`` directory to try, newest first: the ``step_*`` ones
    (whatever ``last`` names), then a ``last`` that is a directory of its own (a merge's output)."""
    found = list(reversed(step_dirs(root)))
    last = root / LAST
    if last.is_dir() and not last.is_symlink():
        found.append(last)
    return found


def _looks_like_checkpoint(path: Path) -> bool:
    return any((path / name).exists() for name in (MANIFEST, ".metadata", META_FILE))


def resolve_checkpoint(path: str | os.PathLike, report: Callable[[str], None] | None = None) -> Path | None:
    """The intact checkpoint directory that ``path`` names, or None.

    Accepts a checkpoint directory (used only if it verifies), a ``checkpoints/`` directory or a
    run directory (the newest ``step_*`` that verifies, whatever ``last`` points at: a newer
    checkpoint than ``last`` wins, a damaged newest one falls back to the previous one), or a
    folder of runs (``runs/pretrain``, a ``--multirun`` sweep's folder: of the runs up to
    `RUN_DEPTH` levels below it, the one that saved last (`saved_at`) and holds an intact
    checkpoint). Every file of a candidate is
    checked against its manifest (sizes and SHA-256, `strategies.checkpoint.dcp.verify_checkpoint`).

    Args:
        report: called with one line per checkpoint passed over and why (damaged, incomplete).
    """
    report = report or (lambda line: None)
    path = Path(path).expanduser()
    if _looks_like_checkpoint(path):
        reason = verify_checkpoint(path)
        if reason is None:
            return path.resolve()
        report(f"{path}: {reason}")
        return None
    for root in (RunDir(path).checkpoints, path):
        candidates = _candidates(root)
        for candidate in candidates:
            reason = verify_checkpoint(candidate)
            if reason is None:
                for unfinished in _unfinished_after(root, candidate):
                    report(f"skipped {unfinished}: a save that did not finish (the run stopped while writing it)")
                return candidate.resolve()
            report(f"skipped {candidate}: {reason}")
        if candidates:
            return None
    for run in sorted(runs_below(path), key=saved_at, reverse=True):
        if (found := resolve_checkpoint(run, report)) is not None:
            return found
    return None


def no_checkpoint_reason(path: str | os.PathLike) -> str:
    """Why ``path`` names no intact checkpoint (`resolve_checkpoint` gave None), for an error message:
    it does not exist, its checkpoints fail their checks (each named with its reason), or it holds none."""
    path = Path(path).expanduser()
    if not path.exists():
        return f"{path} does not exist"
    skipped: list[str] = []
    resolve_checkpoint(path, skipped.append)
    if skipped:
        return f"{path} holds no intact checkpoint ({'; '.join(skipped)})"
    return f"{path} holds no checkpoint"


def _unfinished_after(root: Path, checkpoint: Path) -> list[Path]:
    """The ``step_<n>.tmp`` directories in ``root`` of steps after ``checkpoint``'s: saves a stopped run
    left unfinished (the next save of that step removes them)."""
    step = name_step(checkpoint)
    found = [(p, name_step(p.with_suffix(""))) for p in root.glob("step_*.tmp") if p.is_dir()]
    return sorted((p for p, n in found if n is not None and (step is None or n > step)), key=lambda p: p.name)


def runs_below(folder: Path, depth: int = RUN_DEPTH) -> list[Path]:
    """The run directories (those with a ``checkpoints/``) at most ``depth`` levels below ``folder``:
    ``runs/pretrain/<time>`` and a sweep's ``runs/pretrain/<time>/job0_...`` alike."""
    if depth == 0 or not folder.is_dir():
        return []
    found = []
    for child in sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()):
        found += [child] if RunDir(child).checkpoints.is_dir() else runs_below(child, depth - 1)
    return found


def saved_at(run: Path) -> float:
    """When the run last saved: the newest modification time of its ``checkpoints/step_*``
    directories (of ``checkpoints/`` itself without any), seconds since the epoch."""
    root = RunDir(run).checkpoints
    return max((p.stat().st_mtime for p in step_dirs(root)), default=root.stat().st_mtime)
