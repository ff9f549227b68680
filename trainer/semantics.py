"""The one derivation of a run's resolved facts (`resolve`), and the semantic checks of a composed
config (`check_semantics`). Called by `trainer.config.validate` after the schema and ``_target_``
checks; every problem names the override that fixes it.

The layout's own problems come from the strategy's plugins (``problems(run, shape)``, on the
model built on the meta device), and each component's from its class (``problems(run, node)``,
`trainer.protocols.Component`, asked by `trainer.config.validate`); this module checks only what
lies between config nodes (batch sizes against the layout, sequence length against the model,
paths), and derives the facts the components read (`ResolvedRun`).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from strategies.core.parallel_dims import LayoutError
from strategies.core.ranges import optimizer_problem
from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.mesh import MeshStrategy, build_strategy
from strategies.pipeline.layout import SCHEDULES, stages_per_rank_of
from strategies.planner.layout import layout_of, workload_of
from strategies.planner.time import Cluster, auto_split_points
from trainer.capabilities import (
    capability_problems,
    contract_problems,
    export_fit_problems,
    latent_attention_problems,
    window_problems,
)
from trainer.data.paths import DATA_SUFFIXES, PathProblem, check_path, data_files
from trainer.data.tokenizer import TokenizerFileError, read_tokenizer_json
from trainer.init_from import init_from_problems, run_tokenizer
from trainer.model_node import instantiate_model
from trainer.models.hf import is_hf_dir


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _cause(err: BaseException) -> str:
    """The message of the error Hydra's ``instantiate`` wraps (the constructor's own, naming the key)."""
    return str(err.__cause__ or err)


def tokenizer_file(cfg: DictConfig) -> str | None:
    """The tokenizer file a run loads: ``data.tokenizer``, or with ``data.tokenizer=null`` the
    ``tokenizer.json`` of ``model.init_from`` (a Hugging Face directory's, or a plait run's); None when
    plait trains one."""
    data = cfg.get("data")
    if data is None or "tokenizer" not in data:
        return None
    if data.tokenizer:
        return str(data.tokenizer)
    init_from = cfg.model.get("init_from") if cfg.get("model") is not None else None
    if not init_from:
        return None
    return (
        str(Path(init_from).expanduser() / "tokenizer.json") if is_hf_dir(init_from) else run_tokenizer(str(init_from))
    )


def planned_vocab_size(cfg: DictConfig) -> int | None:
    """The model's vocabulary when the config fixes it: ``model.vocab_size``, the size of the
    tokenizer file, or the size of the BPE plait trains (``data.vocab_size``); None if unknown."""
    model, data = cfg.get("model"), cfg.get("data")
    if model is not None and model.get("vocab_size"):
        return int(model.vocab_size)
    path = tokenizer_file(cfg)
    if path is not None:
        try:
            return read_tokenizer_json(Path(path).expanduser()).get_vocab_size(with_added_tokens=True)
        except TokenizerFileError:  # missing or unreadable: reported by the path checks
            return None
    return int(data.vocab_size) if data is not None and data.get("vocab_size") else None


def _meta_model(cfg: DictConfig, vocab_size: int | None, problems: list[str]) -> Any:
    """The model of ``cfg`` built on the meta device; None without one (or a vocabulary not known yet).

    A constructor's error (e.g. dim not divisible by n_heads) is a problem of the config."""
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or "_target_" not in model:
        return None
    params = inspect.signature(_import(model._target_)).parameters
    kwargs = {}
    if "vocab_size" in params and not model.get("vocab_size"):
        if vocab_size is None and params["vocab_size"].default is inspect.Parameter.empty:
            return None  # a tokenizer that is not known yet: checked when the model is built
        kwargs["vocab_size"] = vocab_size
    try:
        with torch.device("meta"):
            built = instantiate_model(model, **kwargs)
    except Exception as err:  # noqa: BLE001 - the constructor's message names the bad value
        if not any(p.startswith("model.") for p in problems):  # not again what init_from reported
            problems.append(f"model: {_cause(err)}")
        return None
    return built


def _strategy(cfg: DictConfig, problems: list[str]) -> MeshStrategy | None:
    """The strategy node built (its plugins' constructors check their values), or None."""
    try:
        return build_strategy(cfg.strategy)
    except Exception as err:  # noqa: BLE001 - a constructor's message (naming the key) is a config problem
        problems.extend(_cause(err).splitlines())
        return None


def cluster_of(cfg: DictConfig) -> Cluster | None:
    """The `Cluster` of ``cfg.cluster`` (a CPU preset takes its ranks from trainer.devices/num_nodes); None without one."""
    if cfg.get("cluster") is None:
        return None
    fields = OmegaConf.to_container(cfg.cluster, resolve=True)
    if fields.get("device") == "cpu":
        fields.update(devices_per_node=int(cfg.trainer.devices), num_nodes=int(cfg.trainer.num_nodes))
    return Cluster(**fields)


def pp_split_points(cfg: DictConfig, run: ResolvedRun, strategy: MeshStrategy) -> tuple[int, ...] | None:
    """The pipeline's split points (`ResolvedRun.pp_split_points`): ``strategy.pipeline.split_points``
    as given; with ``split=auto``, pp > 1 and a Llama-style model the planner's cost-balanced points
    (`strategies.planner.time.auto_split_points`) for the run's layout and sequence length on
    ``cfg.cluster`` (without one, the time model's defaults of the run's device: compute and memory
    traffic only); otherwise None (equal layer counts)."""
    pipeline = strategy.plugins["pipeline"]
    if run.dims.pp == 1:
        return None
    if pipeline.split_points is not None:
        return tuple(pipeline.split_points)
    if pipeline.split != "auto" or run.shape is None:  # no shape: refused by PipelineParallel.problems
        return None
    cluster = cluster_of(cfg)
    if cluster is None:
        gpu = str(cfg.trainer.accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        cluster = Cluster(device="cuda" if gpu else "cpu")
    float8, async_tp = (bool(OmegaConf.select(cfg, f"planner.{key}", default=False)) for key in ("float8", "async_tp"))
    workload = workload_of(run, strategy, float8=float8, async_tp=async_tp)
    return tuple(auto_split_points(run.shape, layout_of(run, strategy, workload), workload, cluster))


def _row_kind(data: Any) -> str | None:
    """The row kind the data node gives (its class's ``row_kind_of``); None without a data node or
    when its class cannot be imported (reported by the target checks)."""
    if not isinstance(data, DictConfig) or "_target_" not in data:
        return None
    try:
        data_cls = _import(data._target_)
    except (ImportError, AttributeError, ValueError):
        return None
    return data_cls.row_kind_of(data)


def resolve(
    cfg: DictConfig, problems: list[str], broken: frozenset[str] = frozenset(), *, for_launch: bool = True
) -> ResolvedRun | None:
    """The resolved run of ``cfg`` (schema-valid), appending what stops it to ``problems``.

    The only place that derives degrees, world size and micro-batches from the config. Returns
    None when the layout itself cannot be resolved (its problems are in ``problems``).

    Args:
        broken: top-level nodes whose schema check failed (already reported): not instantiated.
        for_launch: False for a run that is only planned (`ResolvedRun.for_launch`).
    """
    train, trainer, data = cfg.train, cfg.trainer, cfg.get("data")
    if trainer.devices < 1 or trainer.num_nodes < 1:  # reported by their declared range (trainer.config)
        return None
    if "strategy" in broken:
        return None
    if not isinstance(cfg.get("strategy"), DictConfig):
        problems.append("strategy is not set; choose a layout with strategy=ddp (or fsdp, nd, ...: conf/strategy/)")
        return None
    strategy = _strategy(cfg, problems)
    if strategy is None:
        return None
    world_size = int(trainer.devices) * int(trainer.num_nodes)
    try:
        dims = strategy.dims.resolve(world_size)
    except LayoutError as err:
        problems.extend(str(err).splitlines())
        return None
    global_batch = train.global_batch_size
    micro = train.micro_batch_size or (1 if dims.pp > 1 else max(1, global_batch // dims.dp))
    per_rank, rest = divmod(global_batch, dims.dp)
    num_micro = per_rank // micro if global_batch > 0 and not rest and per_rank % micro == 0 else 0
    if global_batch > 0 and train.micro_batch_size is None and rest:
        problems.append(
            f"train.global_batch_size={global_batch} must be a multiple of dp={dims.dp}; e.g. "
            f"train.global_batch_size={dims.dp * max(1, per_rank)}"
        )
    elif global_batch > 0 and micro > 0 and (rest or per_rank % micro):
        problems.append(
            f"train.global_batch_size={global_batch} must be a multiple of train.micro_batch_size={micro} x "
            f"dp={dims.dp}; e.g. train.global_batch_size={micro * dims.dp * max(1, per_rank // micro)}"
        )
    pipeline = strategy.plugins["pipeline"]
    schedule = pipeline.schedule
    stages = stages_per_rank_of(schedule, pipeline.stages_per_rank) if schedule in SCHEDULES else 1
    vocab_size = planned_vocab_size(cfg)
    try:
        optimizer = (
            instantiate(cfg.optim, _convert_="all") if cfg.get("optim") is not None and "optim" not in broken else None
        )
    except Exception as err:  # noqa: BLE001 - the optimizer's own message names the bad value
        problems.append(f"optim: {_cause(err)}")
        optimizer = None
    if problem := optimizer_problem(optimizer):
        problems.append(problem)
    init_from = OmegaConf.select(cfg, "model.init_from", default=None, throw_on_missing=False)
    built = None if "model" in broken else _meta_model(cfg, vocab_size, problems)
    # A model without the declared sizes has no shape: a layout that reads them is refused below.
    shape = None if built is None or ModelShape.problem(built) else ModelShape.of(built)
    run = ResolvedRun(
        world_size=world_size,
        dims=dims,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        num_micro_batches=num_micro,
        pp_stages_per_rank=stages,
        pp_microbatches=pipeline.num_microbatches or num_micro,
        seq_len=int(data.seq_len) if data is not None and "seq_len" in data else 0,
        vocab_size=vocab_size,
        shape=shape,
        precision=str(trainer.precision),
        optimizer=optimizer,
        drop_last=bool(data.drop_last) if data is not None and "drop_last" in data else True,
        row_kind=_row_kind(data),
        init_from=str(init_from) if init_from else None,
        compile=bool(strategy.plugins["compile"].enabled),
        sequence_parallel=dims.tp > 1 and bool(strategy.plugins["tensor_parallel"].sequence_parallel),
        cp_placement=str(strategy.plugins["context_parallel"].placement),
        adapters=strategy.plugins.get("lora") is not None,
        islands=strategy.islands,
        for_launch=for_launch,
    )
    problems.extend(strategy.problems(run, run.shape))
    run = replace(run, notes=(*strategy.notes(run, run.shape), *batch_notes(run)))
    problems.extend(contract_problems(cfg, run, built))  # what the layout reads off the model (never skipped)
    problems.extend(window_problems(run, built))
    problems.extend(export_fit_problems(cfg, built))
    problems.extend(latent_attention_problems(run, built))
    # The split is planned for a layout that runs: a config with problems is refused anyway.
    return run if problems else replace(run, pp_split_points=pp_split_points(cfg, run, strategy))


def check_semantics(
    cfg: DictConfig, problems: list[str], broken: frozenset[str] = frozenset(), *, for_launch: bool = True
) -> ResolvedRun | None:
    """Appends the semantic problems of ``cfg`` to ``problems``; returns its resolved run.

    Args:
        broken: top-level nodes whose schema check failed (reported already; see `resolve`).
        for_launch: False for a run that is only planned (`ResolvedRun.for_launch`).
    """
    train, trainer = cfg.train, cfg.trainer
    if trainer.max_steps <= 0:
        problems.append(f"trainer.max_steps={trainer.max_steps} must be positive")
    for name in ("global_batch_size", "micro_batch_size"):
        if train[name] is not None and train[name] <= 0:
            problems.append(f"train.{name}={train[name]} must be positive")
    if train.eval_every < 0:
        problems.append(f"train.eval_every={train.eval_every} must be >= 0")
    if 0 < train.spike_factor <= 1:  # a factor of 1 or less would call every step a spike
        problems.append(
            f"train.spike_factor={train.spike_factor} must be above 1 (10 is Megatron-LM's), or 0 to turn the spike rule off"
        )
    limit = trainer.limit_train_batches
    if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit > 1.0)):
        problems.append(
            f"trainer.limit_train_batches={limit} leaves no training batches; use a fraction in (0, 1] or a positive count"
        )
    problems.extend(fp16_problems(cfg))
    model, data = cfg.model, cfg.data
    if model is not None and data is not None and "seq_len" in data and model.get("max_seq_len") is not None:
        if data.seq_len > model.max_seq_len:
            problems.append(
                f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}; lower data.seq_len or "
                f"raise model.max_seq_len"
            )
    init_from = model is not None and OmegaConf.select(model, "init_from", throw_on_missing=False)
    if init_from:  # HF dir or plait checkpoint
        problems.extend(init_from_problems(model, data=data))
    run = resolve(cfg, problems, broken, for_launch=for_launch)
    problems.extend(capability_problems(cfg, run))  # a Hugging Face mapping (trainer.capabilities)
    if data is not None and data.get("path"):
        problems.extend(_data_path_problems([data.path] if isinstance(data.path, str) else list(data.path)))
    if data is not None and data.get("tokenizer"):
        problems.extend(_tokenizer_problems(str(data.tokenizer)))
    return run


def fp16_problems(cfg: DictConfig) -> list[str]:
    """``trainer.precision=16-true`` keeps the parameters, and so Adam's moments, in float16: an
    ``optim.eps`` below float16's smallest normal number (6.1e-5) rounds to 0 or to a few bits, and
    small squared gradients underflow, so the update divides by ~0 (the pretrain recipe's loss rose
    8.3 -> 10.0 at step 3 and the run stopped as diverged, naming the learning rate)."""
    eps = OmegaConf.select(cfg, "optim.eps", default=None)
    tiny = torch.finfo(torch.float16).tiny
    if cfg.trainer.precision != "16-true" or not isinstance(eps, (int, float)) or eps >= tiny:
        return []
    return [
        f"trainer.precision=16-true keeps the optimizer's moments in float16, where optim.eps={eps:g} is below the "
        f"smallest normal value ({tiny:.2g}) and small squared gradients underflow: the updates blow up; use "
        "trainer.precision=bf16-true (or bf16-mixed), or optim.eps=1e-4"
    ]


def _data_path_problems(given: list[str]) -> list[str]:
    """Each ``data.path`` that does not exist, is not a regular file or a folder, or is a folder
    with an entry named like data that is not a regular file (`trainer.data.paths`)."""
    problems = []
    for path in given:
        try:
            root = check_path(path)
            if root.is_dir():
                data_files(root, DATA_SUFFIXES)
        except FileNotFoundError:
            problems.append(
                f"data.path={path} does not exist; point data.path at a {'/'.join(DATA_SUFFIXES)} file or a directory"
            )
        except PathProblem as err:
            problems.append(f"data.path={path}: {err}")
    return problems


def _tokenizer_problems(given: str) -> list[str]:
    """``data.tokenizer`` that is not a file, or not a ``tokenizer.json`` (bad JSON, truncated, binary)."""
    path = Path(os.path.expanduser(given))
    if not path.is_file():
        return [f"data.tokenizer={given} is not a file; give a tokenizer.json or null to train one"]
    try:
        read_tokenizer_json(path)
    except TokenizerFileError as err:
        return [
            f"data.tokenizer={given} is not a tokenizer.json ({err.reason}); give a Hugging Face tokenizer.json, or null to train one"
        ]
    return []


def batch_notes(run: ResolvedRun) -> list[str]:
    """Launch warnings of the global batches: with ``data.drop_last=false`` and dp > 1 each epoch's
    last, partial batch is trimmed to a multiple of dp rows (`trainer.data.sampler`), so it
    depends on the world size, unlike every other batch."""
    if run.drop_last or run.dims.dp <= 1:
        return []
    return [
        f"data.drop_last=false: each epoch's last, partial global batch is trimmed to a multiple of dp={run.dims.dp} "
        "rows, so another data-parallel degree trains other rows there (and a resume keeps this one); "
        "data.drop_last=true makes every batch independent of the world size"
    ]
