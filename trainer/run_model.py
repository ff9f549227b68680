"""The model of a run, in one process: `load_run_model` is the one way to get it (generate,
export, merge, eval), and `instantiate_saved` the one function that builds objects from a saved
``config.yaml`` (a run directory's layout: `trainer.rundir`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from strategies.checkpoint.dcp import load_model_weights
from strategies.transforms.lora_targets import is_adapter
from trainer.data.tokenizer import Tokenizer
from trainer.model_node import constructor_node, init_from_of
from trainer.models.hf import HFError, is_hf_dir, llama_from_hf, load_hf_weights
from trainer.rundir import RunDir, no_checkpoint_reason, resolve_checkpoint
from trainer.targets import check_targets


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
