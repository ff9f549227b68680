"""Semantic checks of a composed run config: batch sizes against the layout, the model against
the parallel degrees, each technique's own checks, paths. Called by `trainer.config.validate`
after the schema and ``_target_`` checks; every problem names the override that fixes it.

Also the run-wide derived values (world size, data-parallel degree, micro-batch size).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.parallel_dims import LayoutError, ParallelDims


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def world_size(cfg: DictConfig) -> int:
    return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def data_parallel_degree(cfg: DictConfig) -> int:
    """dp = dp_replicate x dp_shard of the validated config's layout."""
    degrees = {k: cfg.strategy[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    return ParallelDims(**degrees).resolve(world_size(cfg)).dp


def micro_batch_size(cfg: DictConfig) -> int:
    """Rows per forward/backward on one rank: train.micro_batch_size, or when null all of the rank's
    rows, or with pp > 1 one row per pipeline micro-batch (a schedule needs several)."""
    degrees = {k: cfg.strategy[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    dims = ParallelDims(**degrees).resolve(world_size(cfg))
    return cfg.train.micro_batch_size or (1 if dims.pp > 1 else cfg.train.global_batch_size // dims.dp)


def check_semantics(cfg: DictConfig, problems: list[str]) -> None:
    """Appends the semantic problems of ``cfg`` (schema-valid) to ``problems``."""
    train, trainer = cfg.train, cfg.trainer
    if trainer.max_steps <= 0:
        problems.append(f"trainer.max_steps={trainer.max_steps} must be positive")
    if trainer.devices < 1 or trainer.num_nodes < 1:
        problems.append("trainer.devices and trainer.num_nodes must be >= 1")
        return
    for name in ("global_batch_size", "micro_batch_size"):
        if train[name] is not None and train[name] <= 0:
            problems.append(f"train.{name}={train[name]} must be positive")
    if train.eval_every < 0:
        problems.append(f"train.eval_every={train.eval_every} must be >= 0")
    limit = trainer.limit_train_batches
    if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit > 1.0)):
        problems.append(
            f"trainer.limit_train_batches={limit} leaves no training batches; use a fraction in (0, 1] or a positive count"
        )
    dims = None
    if cfg.strategy is not None and "dp_shard" in cfg.strategy:
        try:
            dims = ParallelDims(**{k: cfg.strategy[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}).resolve(
                world_size(cfg)
            )
        except LayoutError as err:
            problems.extend(str(err).splitlines())
        strategy_cls = _import(cfg.strategy._target_)
        if dims is not None and hasattr(strategy_cls, "unsupported_degrees"):
            problems.extend(strategy_cls.unsupported_degrees(dims))
    if dims is not None and train.global_batch_size > 0:
        micro = train.micro_batch_size or (1 if dims.pp > 1 else max(1, train.global_batch_size // dims.dp))
        per_rank, rest = divmod(train.global_batch_size, dims.dp)
        if train.micro_batch_size is None and rest:
            problems.append(
                f"train.global_batch_size={train.global_batch_size} must be a multiple of dp={dims.dp}; e.g. "
                f"train.global_batch_size={dims.dp * max(1, per_rank)}"
            )
        elif micro > 0 and (rest or per_rank % micro):
            problems.append(
                f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={micro} x dp={dims.dp}; e.g. "
                f"train.global_batch_size={micro * dims.dp * max(1, per_rank // micro)}"
            )
    model, data = cfg.model, cfg.data
    if model is not None and data is not None and "seq_len" in data and model.get("max_seq_len") is not None:
        if data.seq_len > model.max_seq_len:
            problems.append(
                f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; lower data.seq_len or "
                f"raise model.max_seq_len"
            )
        if data.seq_len <= 0:
            problems.append(f"data.seq_len={data.seq_len} must be positive")
    if dims is not None and model is not None and "n_heads" in model:
        problems.extend(
            dims.check_model(
                n_layers=model.n_layers,
                n_heads=model.n_heads,
                n_kv_heads=model.get("n_kv_heads") or model.n_heads,
                seq_len=data.seq_len if data is not None and "seq_len" in data else 0,
                vocab_size=_planned_vocab_size(model, data),
                ffn_dim=model.get("ffn_dim"),
            )
        )
    if dims is not None and dims.pp > 1 and model is not None and "n_layers" in model:
        _check_pipeline(cfg, dims, problems)
    if dims is not None and isinstance(cfg.strategy.get("local_sgd"), DictConfig):
        _check_local_sgd(cfg, dims, problems)
    if dims is not None and dims.cp > 1 and model is not None and "n_heads" in model and "cp_mode" in cfg.strategy:
        _check_context_parallel(cfg, dims, problems)
    if model is not None and OmegaConf.select(model, "init_from", throw_on_missing=False):  # HF dir or plait checkpoint
        from trainer.models.hf import init_from_problems

        problems.extend(init_from_problems(model, dims=dims, data=data))
    objective = cfg.get("objective")
    if dims is not None and dims.tp > 1 and isinstance(objective, DictConfig) and objective.get("loss_chunk_tokens"):
        problems.append(
            f"objective.loss_chunk_tokens={objective.loss_chunk_tokens} needs tp=1 (with tp > 1 loss parallel already "
            "keeps the logits sharded by vocabulary); use objective.loss_chunk_tokens=0"
        )
    if data is not None and "_target_" in data:
        # A data module may check its own node (SFT sources and budgets: trainer.data.sft).
        data_cls = _import(data._target_)
        if hasattr(data_cls, "config_problems"):
            problems.extend(data_cls.config_problems(data))
    objective = cfg.get("objective")
    if isinstance(objective, DictConfig) and "_target_" in objective:
        # An objective may check the layout and data it needs (preference pairs: trainer.objectives.preference).
        objective_cls = _import(objective._target_)
        if hasattr(objective_cls, "config_problems"):
            problems.extend(objective_cls.config_problems(cfg, dims))
    if data is not None and data.get("path"):
        paths = [data.path] if isinstance(data.path, str) else list(data.path)
        for path in paths:
            if not Path(os.path.expanduser(path)).exists():
                problems.append(f"data.path={path} does not exist; point data.path at a .txt/.jsonl file or a directory")
    if data is not None and data.get("tokenizer") and not Path(os.path.expanduser(data.tokenizer)).is_file():
        problems.append(f"data.tokenizer={data.tokenizer} is not a file; give a tokenizer.json or null to train one")


def _check_pipeline(cfg: DictConfig, dims: ParallelDims, problems: list[str]) -> None:
    """Pipeline layout against the model's layers and the step's micro-batches (strategies.pipeline)."""
    from strategies.pipeline_layout import SCHEDULES, check_pipeline

    if "pp_schedule" not in cfg.strategy or not isinstance(cfg.strategy.get("pipeline"), DictConfig):
        return  # a strategy without these settings checks its pipeline when it builds it
    if cfg.strategy.pp_schedule not in SCHEDULES:
        return  # reported by the type check of strategy.pp_schedule
    train, pipeline = cfg.train, cfg.strategy.pipeline
    micro = train.micro_batch_size or 1  # null: one row per pipeline micro-batch (see micro_batch_size)
    per_rank = train.global_batch_size // dims.dp
    problems.extend(
        check_pipeline(
            pp=dims.pp,
            schedule=cfg.strategy.pp_schedule,
            stages_per_rank=pipeline.get("stages_per_rank"),
            split_points=pipeline.get("split_points"),
            num_microbatches=pipeline.get("num_microbatches"),
            microbatches_per_step=per_rank // micro if micro > 0 and per_rank % micro == 0 and per_rank else None,
            n_layers=cfg.model.n_layers,
            tie_embeddings=bool(cfg.model.get("tie_embeddings")),
        )
    )
    if cfg.data is not None and cfg.data.get("drop_last") is False:
        problems.append(
            "data.drop_last=false gives a last, partial global batch, which does not fill the pipeline's "
            "micro-batches; use data.drop_last=true with strategy.pp > 1"
        )


def _check_context_parallel(cfg: DictConfig, dims: ParallelDims, problems: list[str]) -> None:
    """Context-parallel mode against the model's heads (strategies.context)."""
    from strategies.context import CP_MODES, context_parallel_problems

    if cfg.strategy.cp_mode not in CP_MODES:
        return  # reported by the type check of strategy.cp_mode
    plugin = cfg.strategy.get("context_parallel")
    problems.extend(
        context_parallel_problems(
            mode=cfg.strategy.cp_mode,
            cp=dims.cp,
            tp=dims.tp,
            ulysses_degree=plugin.ulysses_degree if isinstance(plugin, DictConfig) else 2,
            n_heads=cfg.model.n_heads,
            n_kv_heads=cfg.model.get("n_kv_heads") or cfg.model.n_heads,
        )
    )


def _planned_vocab_size(model: DictConfig, data: DictConfig | None) -> int | None:
    """The model's vocabulary size when the config fixes it: ``model.vocab_size``, or the size of
    the tokenizer plait trains (``data.vocab_size``); None for a tokenizer file (known at build)."""
    if model.get("vocab_size"):
        return int(model.vocab_size)
    if data is not None and not data.get("tokenizer") and data.get("vocab_size"):
        return int(data.vocab_size)
    return None


def _check_local_sgd(cfg: DictConfig, dims: ParallelDims, problems: list[str]) -> None:
    """The local-SGD plugin's own checks (islands, periods, inner optimizer; strategies.local_sgd)."""
    from hydra.utils import instantiate

    try:
        plugin = instantiate(cfg.strategy.local_sgd)
        optimizer = instantiate(cfg.optim, _convert_="all") if cfg.optim is not None else None
    except Exception as err:  # noqa: BLE001 - a bad value (the constructor names it) is a config problem
        cause = err.__cause__ or err
        problems.append(f"strategy.local_sgd: {cause}")
        return
    n_layers = cfg.model.n_layers if cfg.model is not None and "n_layers" in cfg.model else 1
    problems.extend(plugin.problems(dims=dims, optimizer=optimizer, n_layers=n_layers))
