"""A run directory's layout, the checkpoint a path names, and the model of a run.

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

`RunDir` is the only place these names are spelled. `load_run_model` is the one way to get the
model of a run (generate, export, merge), and `instantiate_saved` the one function that builds
objects from a saved ``config.yaml``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from strategies.checkpoint.dcp import META_FILE, is_checkpoint, load_model_weights, verify_checkpoint
from strategies.checkpoint.manifest import MANIFEST
from strategies.transforms.lora_targets import is_adapter
from trainer.checkpoint_step import name_step
from trainer.data.tokenizer import Tokenizer
from trainer.model_node import constructor_node, init_from_of
from trainer.models.hf import HFError, is_hf_dir, llama_from_hf, load_hf_weights
from trainer.targets import check_targets

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
    pairs = [o.replace("=", ":", 1) for o in overrides]
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


def instantiate_saved(node: DictConfig, *, source: str, key: str, trust: Sequence[str] = (), **kwargs: Any) -> Any:
    """The object that a node of a saved run's ``config.yaml`` describes (``_target_`` + fields).

    The one place plait builds objects from a run directory it did not just compose: the file may
    come from elsewhere, so every ``_target_`` in it must be a class of plait or of a package in
    ``trust`` (`trainer.targets.check_targets`) before anything is imported or built.

    Args:
        node: a node of `RunDir.load_config` (e.g. ``cfg.model``).
        source: the file it was read from; key: its dotted key there (for the message).
        trust: top-level packages besides plait whose classes may be built (``trust=[my_pkg]``).
        kwargs: fields the saved node leaves open (e.g. ``vocab_size``).

    Raises:
        UntrustedTargetError: a ``_target_`` outside plait and ``trust``; nothing was built.
        HFError: the node builds from a Hugging Face directory that cannot be read now (moved or
            deleted since the run: ``model.config_from``/``init_from`` of ``source``).
    """
    check_targets(node, source=source, key=key, trust=trust)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, HFError):  # the run's architecture lives in that directory
            raise HFError(
                f"{source} ({key}) builds from a Hugging Face directory that cannot be read: {err.__cause__}; if "
                "it moved, set its new path in that config.yaml (model.config_from, or model.init_from)"
            ) from None
        raise


def load_run_weights(path: str | os.PathLike, model: nn.Module, keys: Callable[[str], bool] | None = None) -> Path:
    """Loads the model weights of the checkpoint ``path`` names (`resolve_checkpoint`) into
    ``model`` (any saved world size and layout: DCP reshards); returns the checkpoint directory.
    ``keys``: which entries (FQNs) to load; None: all.

    Raises:
        FileNotFoundError: ``path`` names no checkpoint.
    """
    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path} names no checkpoint; give a run directory or a step_* checkpoint")
    load_model_weights(ckpt, model, keys)
    return ckpt


@dataclass(frozen=True)
class RunModel:
    """The model of a run with what describes it.

    Args:
        model: built from the run's ``config.yaml``, weights from ``checkpoint``, on the CPU (a
            LoRA run's: ``model.init_from``'s base with the checkpoint's adapters, not merged).
        tokenizer: the run's tokenizer (None when the run has no ``tokenizer.json``).
        config: the run's ``config.yaml``.
        run: the run directory.
        checkpoint: the checkpoint directory the weights come from.
    """

    model: nn.Module
    tokenizer: Any
    config: DictConfig
    run: RunDir
    checkpoint: Path


def load_hf_model(path: str | os.PathLike) -> RunModel:
    """A Hugging Face model directory as a run's model (``plait generate``/``chat`` ``ckpt=DIR``):
    the architecture of its ``config.json`` (the ``model=hf`` builder), its safetensors weights,
    the ``tokenizer.json`` and chat template beside them (its directory stands for the run's).

    Raises:
        HFError: the directory's config or weights are not a family plait reads.
    """
    directory = Path(path).expanduser()
    model = llama_from_hf(str(directory))
    load_hf_weights(model, directory)
    tokenizer = Tokenizer.from_file(directory / "tokenizer.json") if (directory / "tokenizer.json").is_file() else None
    config = OmegaConf.create({"model": {"_target_": HF_BUILDER, "init_from": str(directory)}})
    model.eval()
    return RunModel(model=model, tokenizer=tokenizer, config=config, run=RunDir(directory), checkpoint=directory)


# The builder of a model whose architecture is a Hugging Face directory's (``model=hf``).
HF_BUILDER = f"{llama_from_hf.__module__}.{llama_from_hf.__qualname__}"


def load_run_model(
    path: str | os.PathLike,
    *,
    load_base: Callable[[nn.Module, str], None] | None = None,
    trust: Sequence[str] = (),
    report: Callable[[str], None] | None = None,
) -> RunModel:
    """The model of the run (or checkpoint) ``path`` names, in one process, in eval mode.

    Args:
        load_base: for a LoRA run, loads its base (the source ``model.init_from`` names) into the
            model: `trainer.init_from.load_init_from` (passed in: that module imports this one).
        trust: packages besides plait whose classes the run's config may build (`instantiate_saved`).
        report: called with each newer checkpoint passed over and why (`resolve_checkpoint`).

    Raises:
        FileNotFoundError: ``path`` names no intact checkpoint, or the run has neither
            ``model.vocab_size`` nor a ``tokenizer.json``.
        ValueError: a LoRA run without ``load_base``.
        UntrustedTargetError: the run's config names a model outside plait and ``trust``.
        CheckpointError: the checkpoint refuses a safe load or holds NaN/inf.
    """
    if is_hf_dir(path):
        return load_hf_model(path)
    ckpt = resolve_checkpoint(path, report)
    if ckpt is None:
        raise FileNotFoundError(
            f"{no_checkpoint_reason(path)}; give a run directory, a step_* checkpoint or a Hugging Face model directory"
        )
    run = RunDir.of_checkpoint(ckpt)
    cfg = run.load_config()
    tokenizer = Tokenizer.from_file(str(run.tokenizer)) if run.tokenizer.is_file() else None
    vocab_size = cfg.model.get("vocab_size") or (tokenizer.vocab_size if tokenizer is not None else None)
    if vocab_size is None:
        raise FileNotFoundError(f"{run.path} has no {run.tokenizer.name} and its config sets no model.vocab_size")
    source = str(run.config)
    check_targets(cfg.model, source=source, key="model", trust=trust)  # before constructor_node imports it
    model = instantiate_saved(
        constructor_node(cfg.model), source=source, key="model", trust=trust, vocab_size=vocab_size
    )
    lora = cfg.strategy.get("lora") if cfg.get("strategy") is not None else None
    if lora is None:
        load_run_weights(ckpt, model)
    elif load_base is None:
        raise ValueError(
            f"{ckpt} holds LoRA adapters (strategy.lora) on a base it does not hold; export the run first (plait "
            "export) and use the export, or, in Python, pass load_base=trainer.init_from.load_init_from (it loads "
            "model.init_from's base)"
        )
    else:  # a LoRA run's checkpoint holds the adapters; its base is model.init_from
        instantiate_saved(lora, source=source, key="strategy.lora", trust=trust).attach(model)
        load_base(model, init_from_of(cfg.model))
        load_run_weights(ckpt, model, keys=is_adapter)
    model.eval()
    return RunModel(model=model, tokenizer=tokenizer, config=cfg, run=run, checkpoint=ckpt)
