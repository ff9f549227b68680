"""The one place that instantiates objects from a validated config: nothing is altered after it is built.

Every builder receives the run's `ResolvedRun` (`trainer.config.validate`), so nothing here
derives degrees or micro-batches again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class, get_object, instantiate
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf
from torch import nn

from strategies.core.model_contract import flops_per_token, optional
from strategies.core.resolved import ResolvedRun
from strategies.mesh import MeshStrategy
from strategies.mesh import build_strategy as build_mesh_strategy
from trainer.config import ConfigError, validate
from trainer.data.base import DataModule
from trainer.hf_sources import source_dirs
from trainer.loggers import LogConfig
from trainer.model_node import init_from_of, instantiate_model
from trainer.nonfinite import NonFiniteGuard
from trainer.rundir import RunDir
from trainer.semantics import tokenizer_file
from trainer.spikes import SpikeRule
from trainer.task import Task


def build_data(cfg: DictConfig, run: ResolvedRun | None = None) -> DataModule:
    """The data module, given the resolved run; with ``data.tokenizer=null`` and a Hugging Face
    ``model.init_from``, the checkpoint's own ``tokenizer.json`` (and, beside it, its chat template).

    Args:
        run: the config's resolved run; None validates ``cfg`` here (scripts and tests).

    Raises:
        ConfigError: with ``run=None``, the problems of ``cfg``.
    """
    run = validate(cfg) if run is None else run
    extra = {}
    if "tokenizer" in cfg.data and cfg.data.tokenizer is None and tokenizer_file(cfg) is not None:
        extra["tokenizer"] = tokenizer_file(cfg)
    # Hydra would read a dataclass keyword as config: the run is passed to the partial instead.
    return instantiate(cfg.data, _partial_=True, _convert_="all", **extra)(run=run)


def build_model(cfg: DictConfig, run: ResolvedRun, *, vocab_size: int) -> nn.Module:
    """The model, initialised from ``cfg.seed`` (same weights at any world size and layout).

    With more than one rank, a model class whose ``META_INIT`` is true is built on the meta device:
    the strategy allocates and fills only each rank's shards (`MeshStrategy.materialize`).

    Args:
        vocab_size: the tokenizer's size (the model's, unless ``model.vocab_size`` pads it).

    Raises:
        ConfigError: the tokenizer is larger than ``model.vocab_size``, or tp does not divide its size.
    """
    planned = cfg.model.get("vocab_size")
    if planned is not None and planned < vocab_size:
        raise ConfigError(
            [
                f"model.vocab_size={planned} is smaller than the tokenizer's {vocab_size} tokens; "
                f"use model.vocab_size>={vocab_size} (a larger value pads the embedding)"
            ]
        )
    tp = run.dims.tp
    if planned is None and tp > 1 and vocab_size % tp:  # a trained tokenizer: its size is known only now
        raise ConfigError(
            [
                f"strategy.tp={tp} does not divide the tokenizer's {vocab_size} tokens (the embedding and the LM head "
                f"are sharded by vocabulary rows); pad them with +model.vocab_size={-(-vocab_size // tp) * tp}"
            ]
        )
    torch.manual_seed(cfg.seed)
    # Sharded layouts build on the meta device: the strategy allocates and initialises only each
    # rank's shards after parallelizing (MeshStrategy.materialize), so no rank holds the whole model.
    target = get_object(cfg.model._target_) if isinstance(cfg.model.get("_target_"), str) else None
    on_meta = run.world_size > 1 and inspect.isclass(target) and optional(target, "META_INIT")
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return instantiate_model(cfg.model, vocab_size=planned or vocab_size)


def build_task(cfg: DictConfig, run: ResolvedRun, model: nn.Module) -> Task:
    return Task(
        model=model,
        objective=instantiate(cfg.objective),
        optimizer=instantiate(cfg.optim, _convert_="all"),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler is not None else None,
        micro_batch_size=run.micro_batch_size,
        max_grad_norm=cfg.train.max_grad_norm,
        # The param groups override the optimizer's own weight_decay: pass the configured one (C16).
        weight_decay=cfg.optim.weight_decay,
        no_decay=tuple(cfg.train.no_decay),
        eval_every=cfg.train.eval_every,
        flops_per_token=flops_per_token(model, run.seq_len),
        init_from=init_from_of(cfg.model),
        nonfinite=NonFiniteGuard(
            cfg.train.nonfinite,
            cfg.train.max_nonfinite_steps,
            cfg.train.max_skipped_steps,
            spikes=SpikeRule(cfg.train.spike_factor, cfg.train.spike_window) if cfg.train.spike_factor else None,
            recover_after=cfg.train.spike_window,
            max_rollbacks=cfg.train.max_rollbacks,
        ),
    )


def build_strategy(cfg: DictConfig, run: ResolvedRun, *, launcher: str = "subprocess") -> MeshStrategy:
    """The strategy of ``cfg.strategy`` for the resolved run (`strategies.mesh.build_strategy`); its
    pipeline plugin takes the run's split points (``ResolvedRun.pp_split_points``: with
    ``strategy.pipeline.split=auto``, the planner's balanced stages)."""
    node = cfg.strategy
    if run.pp_split_points is not None and isinstance(node.get("pipeline"), DictConfig):
        node = OmegaConf.merge(node, {"pipeline": {"split_points": list(run.pp_split_points)}})
    return build_mesh_strategy(node, run=run, launcher=launcher)


def _with_run(node: DictConfig, **values: Any) -> Any:
    """Instantiates ``node``, passing each ``key=value`` its target takes and the node leaves unset."""
    target = get_class(node._target_) if "_target_" in node else None
    params = inspect.signature(target).parameters if target is not None else {}
    return instantiate(node, **{k: v for k, v in values.items() if k in params and node.get(k) is None})


def build_callbacks(cfg: DictConfig, run_dir: Path) -> list[L.Callback]:
    """The ``callbacks`` nodes built, each given what it takes of the run: ``dirpath`` (the run
    directory; the checkpoints folder for ``checkpoint``) and ``model_sources`` (the Hugging Face
    directories that describe the model, `trainer.hf_sources.source_dirs`: an export during the run
    writes what ``plait export`` writes)."""
    callbacks = []
    sources = [str(path) for path in source_dirs(cfg)]
    config_sources = [str(path) for path in source_dirs(cfg, tokenizer=False)]
    for name, node in (cfg.callbacks or {}).items():
        if node is None or (name == "progress" and not cfg.trainer.enable_progress_bar):
            continue
        dirpath = RunDir(run_dir).checkpoints if name == "checkpoint" else run_dir
        callbacks.append(_with_run(node, dirpath=str(dirpath), model_sources=sources, config_sources=config_sources))
    return callbacks


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Any]:
    return [_with_run(node, save_dir=str(run_dir)) for node in (cfg.logger or {}).values() if node is not None]


def build_trainer(
    cfg: DictConfig,
    run: ResolvedRun,
    run_dir: Path,
    *,
    launcher: str = "subprocess",
    callbacks: Sequence[L.Callback] = (),
) -> L.Trainer:
    """The Lightning trainer: ``cfg.callbacks`` and ``cfg.logger``, then ``callbacks`` (the launch's own,
    e.g. `trainer.resume_record.ResumeRecord`), and the strategy (`build_strategy`).
    """
    trainer_cfg = OmegaConf.to_container(cfg.trainer)
    extra, callbacks = list(callbacks), build_callbacks(cfg, run_dir)
    loggers = build_loggers(cfg, run_dir)
    if loggers:
        callbacks.append(LogConfig(OmegaConf.to_container(cfg, resolve=True)))
    callbacks += extra
    return L.Trainer(
        **trainer_cfg,
        strategy=build_strategy(cfg, run, launcher=launcher),
        callbacks=callbacks,
        logger=loggers or False,
        default_root_dir=str(run_dir),
        max_epochs=-1,  # max_steps ends the run
        use_distributed_sampler=False,  # the global-batch sampler slices by dp rank itself
        # PeriodicCheckpoint (a Lightning Checkpoint) saves DCP directories; no ModelCheckpoint without it.
        enable_checkpointing=any(isinstance(callback, Checkpoint) for callback in callbacks),
        limit_val_batches=0,  # the Task evaluates at its own steps (step 0 included)
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )


def prepared_data(cfg: DictConfig, run: ResolvedRun) -> DataModule:
    """The data module, prepared (`DataModule.prepare`), after seeding every RNG from ``cfg.seed``:
    the first half of `build_run`, for a launch that checks the data before it builds the rest.

    Raises:
        DataError: data that cannot be trained on.
    """
    # Python, NumPy and torch RNGs of every rank (Lightning re-seeds each process from PL_GLOBAL_SEED).
    L.seed_everything(cfg.seed, verbose=False)
    data = build_data(cfg, run)
    data.prepare()
    return data


def build_fit(
    cfg: DictConfig,
    run: ResolvedRun,
    run_dir: Path,
    data: DataModule,
    *,
    launcher: str = "subprocess",
    callbacks: Sequence[L.Callback] = (),
) -> tuple[L.Trainer, Task]:
    """Model, task and trainer (with ``callbacks`` besides the config's) of one run, on ``data``
    from `prepared_data`: the second half of `build_run`.

    Raises:
        ConfigError: the tokenizer does not fit the model (`build_model`).
    """
    model = build_model(cfg, run, vocab_size=data.tokenizer.vocab_size)
    task = build_task(cfg, run, model)
    return build_trainer(cfg, run, run_dir, launcher=launcher, callbacks=callbacks), task


def build_run(
    cfg: DictConfig,
    run_dir: Path,
    run: ResolvedRun | None = None,
    *,
    launcher: str = "subprocess",
    callbacks: Sequence[L.Callback] = (),
) -> tuple[L.Trainer, Task, DataModule]:
    """Data (prepared), model, task and trainer of one run (`prepared_data`, then `build_fit`).

    Args:
        run: the config's resolved run (`trainer.config.validate`); None validates ``cfg`` here
            (scripts and tests that build in-process).
        callbacks: the trainer's callbacks besides the config's.

    Raises:
        ConfigError: with ``run=None``, the problems of ``cfg``.
    """
    run = validate(cfg) if run is None else run
    data = prepared_data(cfg, run)
    trainer, task = build_fit(cfg, run, run_dir, data, launcher=launcher, callbacks=callbacks)
    return trainer, task, data
