"""``model.init_from``: loading a Hugging Face directory or a plait checkpoint / run directory
into a (possibly parallelized) model, and the checks `trainer.config.validate` makes of it first.

The key is the user's on the model node, but models never read it (`trainer.model_node`):
`trainer.build.build_task` hands it to `trainer.task.Task`, whose ``configure_model`` loads it
after the strategy has parallelized the model (`load_init_from`).

A plait run started from another plait run takes that run's architecture (its ``config.yaml``
model node, `take_run_model`, applied where the config is composed) and its ``tokenizer.json``
(`run_tokenizer`, unless ``data.tokenizer`` is given), so ``plait sft model.init_from=runs/pretrain/...``
needs no model override; an explicit override that changes a weight's shape is refused in validate.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from strategies.checkpoint.manifest import digest
from strategies.transforms.lora_targets import is_adapter
from trainer.models.hf import (
    HFError,
    is_hf_dir,
    llama_kwargs,
    load_hf_weights,
    read_config,
    sliding_window,
    weight_files,
)
from trainer.run_model import HF_BUILDER, load_run_weights
from trainer.rundir import RunDir, no_checkpoint_reason, resolve_checkpoint
from trainer.targets import check_targets


def load_init_from(model: nn.Module, source: str | None) -> None:
    """Loads ``source`` (``model.init_from``: a Hugging Face directory or a plait checkpoint / run
    directory) into the (possibly parallelized) model; nothing when it is None. Every rank calls it.
    LoRA adapters (`strategies.transforms.lora_targets.is_adapter`) are not loaded: the base is.

    Raises:
        HFError: ``source`` is neither, or its weights do not fit the model.
    """
    if not source:
        return
    if is_hf_dir(source):
        load_hf_weights(model, source, skip=is_adapter)
        return
    try:
        load_run_weights(source, model, keys=lambda fqn: not is_adapter(fqn))
    except FileNotFoundError:
        raise HFError(f"model.init_from={source} is neither a Hugging Face directory nor a plait checkpoint") from None


def builds_from_hf(node: Any) -> bool:
    """Whether a model node (maybe another run's, never imported here) is built by `HF_BUILDER`."""
    return str(node.get("_target_", "")) == HF_BUILDER


# Model fields a run may set apart from the plait run it starts from: no weight changes shape.
FREE_FIELDS = frozenset({"init_from", "config_from", "init_std", "max_seq_len"})


def base_run(source: str | None) -> tuple[Path, DictConfig, Path] | None:
    """(the run directory, its ``config.yaml``, the checkpoint) of the plait run or checkpoint
    ``source`` names (a run: its newest intact checkpoint); None for a Hugging Face directory, no
    intact checkpoint, or a checkpoint outside a run directory."""
    if not source or is_hf_dir(source):
        return None
    ckpt = resolve_checkpoint(Path(source).expanduser())
    if ckpt is None:
        return None
    run = RunDir.of_checkpoint(ckpt)
    return (run.path, run.load_config(), ckpt) if run.config.is_file() else None


def started_from(source: str | None) -> dict[str, str] | None:
    """The checkpoint ``model.init_from`` (``source``) names now, as a run records the weights it
    started from (`trainer.resume.run_record`'s ``base``, taken at a fresh start and kept by every
    resume): ``{"checkpoint": its canonical path, "digest": its manifest's SHA-256}``. A full fine-tune
    keeps the base run's directory as ``model.init_from`` (`take_run_model`), which names that run's
    newest checkpoint once it trains on: the record says which one the fine-tune started from
    (`trainer.merge.base_problems`). None: no ``source``, a Hugging Face directory, no checkpoint, or
    a checkpoint without a manifest (`strategies.checkpoint.manifest.digest`)."""
    if not source or is_hf_dir(source):
        return None
    ckpt = resolve_checkpoint(Path(source).expanduser())
    found = digest(ckpt) if ckpt is not None else None
    return None if found is None else {"checkpoint": os.path.realpath(ckpt), "digest": found}


def run_tokenizer(source: str | None) -> str | None:
    """The ``tokenizer.json`` of the plait run ``source`` names (None: not a plait run, or none there)."""
    found = base_run(source)
    if found is None:
        return None
    tokenizer = found[0] / "tokenizer.json"
    return str(tokenizer) if tokenizer.is_file() else None


def _explicit_model_keys(overrides: Sequence[str]) -> set[str] | None:
    """The ``model.<key>`` fields the overrides set or delete (first level); None when they choose
    the model group itself (``model=nano``: every field is the user's)."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "model":
            return None
        if key.startswith("model."):
            keys.add(key.split(".")[1])
    return keys


def take_run_model(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``cfg`` whose model node is that of the plait run ``model.init_from`` names, with the fields
    the user overrode (``overrides``: the command line's) kept; ``cfg`` itself when init_from is not a
    plait run, or when ``model=<group>`` is among the overrides (validate then compares the two).

    A LoRA run (``strategy.lora``) pins a run directory as ``model.init_from`` to the checkpoint it
    names now (its newest): its checkpoints hold only adapters and it reloads its base on every
    load (generate, export, resume), so with the directory recorded it silently used the base run's
    newer checkpoints once that run trained on. A full fine-tune keeps the directory: its
    checkpoints hold every weight, and a pinned checkpoint that the base run's ``keep_last`` later
    deletes would refuse its resume.

    The recipe's default model (``model: tiny``) is not the user's choice: starting from a nano run,
    the run's architecture replaces it. Called where the config is composed (`trainer.compose.compose`,
    the train command before and inside its Hydra job), never by validate, which does not mutate.

    The run directory may come from anywhere, and validate instantiates the model node (Hydra
    builds every nested ``_target_``): every field taken from its ``config.yaml`` passes
    `trainer.targets.check_targets` first, as a run's model does for generate; ``cfg.trust`` names
    the packages besides plait it may build from. The fields the user gave are the user's own.

    Raises:
        UntrustedTargetError: a taken field names a ``_target_`` outside plait and ``cfg.trust``.
    """
    model = cfg.get("model") if isinstance(cfg, DictConfig) else None
    if not isinstance(model, DictConfig) or not model.get("init_from"):
        return cfg
    found = base_run(str(model.init_from))
    explicit = _explicit_model_keys(overrides)
    if found is None:
        return cfg
    pin = OmegaConf.select(cfg, "strategy.lora", default=None) is not None  # adapters on this exact base
    if explicit is None or not isinstance(found[1].get("model"), DictConfig):
        return _pinned(cfg, found[2]) if pin else cfg
    saved = found[1].model
    taken = {
        k: v for k, v in OmegaConf.to_container(saved, resolve=False).items() if k not in explicit and k != "init_from"
    }
    check_targets(taken, source=str(found[0] / "config.yaml"), key="model", trust=cfg.trust)
    node = copy.deepcopy(saved)
    with open_dict(node):
        if builds_from_hf(saved):  # a run of a Hugging Face model: the architecture stays in that directory
            node.config_from = saved.get("config_from") or saved.init_from
        for key in explicit:
            if key in model:
                node[key] = copy.deepcopy(model[key])
            elif key in node:
                del node[key]
        node.init_from = str(found[2]) if pin else model.init_from  # LoRA: the checkpoint, not the directory
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.model = node
    return cfg


def _pinned(cfg: DictConfig, checkpoint: Path) -> DictConfig:
    """A copy of ``cfg`` whose ``model.init_from`` is ``checkpoint`` (`take_run_model`)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        cfg.model.init_from = str(checkpoint)
    return cfg


def _run_problems(model: Any, data: Any, source: str) -> list[str]:
    """Problems of a plait run as ``model.init_from``: a run whose checkpoints hold only adapters
    (its ``strategy.lora``), another architecture, or no tokenizer to take. (A run of a Hugging Face
    model is a base like any other: `take_run_model` keeps its architecture's directory.)"""
    found = base_run(source)
    if found is None:
        return []  # a bare checkpoint: its weights are checked when they load
    run_dir, saved_cfg, _ = found
    problems = []
    if OmegaConf.select(saved_cfg, "strategy.lora", throw_on_missing=False) is not None:
        problems.append(
            f"model.init_from={source} is a LoRA run: its checkpoints hold only the adapters, not a base; export it "
            f"(plait export ckpt={source} out=<dir>: the merged model) and use model=hf model.init_from=<dir>"
        )
    saved = saved_cfg.get("model")
    if not isinstance(saved, DictConfig):
        return problems
    mine, theirs = OmegaConf.to_container(model, resolve=True), OmegaConf.to_container(saved, resolve=True)
    for key in sorted((set(mine) | set(theirs)) - FREE_FIELDS, key=str):
        if mine.get(key) != theirs.get(key):
            problems.append(
                f"model.{key}={mine.get(key)} differs from model.{key}={theirs.get(key)} of the run model.init_from "
                f"names ({run_dir / 'config.yaml'}): drop the override (model.init_from takes the run's architecture)"
            )
    if (
        data is not None
        and "tokenizer" in data
        and data.tokenizer is None
        and not (run_dir / "tokenizer.json").is_file()
    ):
        problems.append(
            f"model.init_from={source}: {run_dir} has no tokenizer.json; give its tokenizer with data.tokenizer=..."
        )
    return problems


def init_from_problems(model: Any, *, data: Any = None) -> list[str]:
    """Problems of ``model.init_from`` for `trainer.config.validate` (before any process group).

    The layout is checked against the checkpoint's sizes by the plugins (on the model's shape,
    which validate builds from the same config.json).

    Args:
        model: the composed ``model`` node (``init_from`` set).
        data: the ``data`` node (its ``seq_len`` against the checkpoint's context and window).
    """
    source = str(model.init_from)
    wants_hf = builds_from_hf(model)
    missing = not Path(source).expanduser().exists()
    if not is_hf_dir(source):
        config_from = model.get("config_from") if wants_hf else None
        if wants_hf and not config_from:
            why = "does not exist" if missing else "has no config.json"
            if not missing and resolve_checkpoint(source) is not None:  # a plait run: its config.yaml builds it
                why += (
                    f" (it is a plait run: drop model=hf, and model.init_from={source} builds the run's own model, "
                    "a Hugging Face architecture included)"
                )
            return [f"model.init_from={source} {why}; model=hf needs a Hugging Face model directory"]
        if config_from and not is_hf_dir(config_from):
            return [
                f"model.config_from={config_from} (the Hugging Face directory the run model.init_from={source} started "
                f"from) has no config.json; if it moved, name it: +model.config_from=<its new directory>"
            ]
        if missing:
            return [
                f"model.init_from={source} does not exist; give a Hugging Face model directory or a plait run or checkpoint"
            ]
        if resolve_checkpoint(Path(source).expanduser()) is None:
            return [
                f"model.init_from={source} is neither a Hugging Face model directory (config.json) nor a plait "
                f"checkpoint or run directory: {no_checkpoint_reason(source)}"
            ]
        return _run_problems(model, data, source)
    if not wants_hf:
        return [
            f"model.init_from={source} is a Hugging Face directory, whose config.json sets the architecture: "
            f"use model=hf model.init_from={source}"
        ]
    try:
        config = read_config(source)
        kwargs = llama_kwargs(config)
        weight_files(source)
    except HFError as err:
        return [f"model.init_from={source}: {err}"]
    problems = []
    max_seq_len = model.get("max_seq_len") or kwargs["max_seq_len"]
    window = sliding_window(config)
    seq_len = data.get("seq_len") if data is not None else None
    if model.get("max_seq_len") and model.max_seq_len > kwargs["max_seq_len"]:
        problems.append(
            f"model.max_seq_len={model.max_seq_len} exceeds the checkpoint's context of {kwargs['max_seq_len']} "
            f"(max_position_embeddings{' and sliding_window' if window else ''} of {source}/config.json)"
        )
    elif seq_len and seq_len > max_seq_len:
        problems.append(f"data.seq_len={seq_len} exceeds the checkpoint's context of {max_seq_len}; lower data.seq_len")
    if data is not None and "tokenizer" in data and data.tokenizer is None:
        if not (Path(source).expanduser() / "tokenizer.json").is_file():
            problems.append(
                f"model.init_from={source} has no tokenizer.json; give its tokenizer with data.tokenizer=..."
            )
    return problems
