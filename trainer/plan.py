"""``plait plan [RECIPE] overrides``: rank parallel layouts before training; ``planner.check``.

Invocations::

    plait plan model=llama3_8b data.seq_len=8192 train.global_batch_size=16 cluster=h100x8
    plait plan model=llama3_70b cluster=h100x256 train.global_batch_size=512 trainer.precision=bf16-mixed
    plait plan model=nano cluster=cpu trainer.devices=2 planner.calibrate=true   # measure this machine first
    plait pretrain planner.check=true cluster=h100x8 model=llama3_8b ...        # fail a predicted OOM

The config is composed exactly as for a run (same recipe, same overrides), so the model, sequence
length, global batch, precision and optimizer are the run's; ``cluster=`` names the machine.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from strategies.resolved import ResolvedRun
from trainer.config import ConfigError


def cluster_from_config(cfg: DictConfig):  # -> strategies.planner.time.Cluster
    """The `Cluster` of ``cfg.cluster``; a CPU preset takes its ranks from trainer.devices/num_nodes.

    Raises:
        ConfigError: no cluster selected.
    """
    from strategies.planner.time import Cluster

    if cfg.get("cluster") is None:
        raise ConfigError(["the planner needs a machine: add cluster=<preset> (conf/cluster/: h100x8, h100x64, cpu, ...)"])
    fields = OmegaConf.to_container(cfg.cluster, resolve=True)
    if fields.get("device") == "cpu":
        fields.update(devices_per_node=int(cfg.trainer.devices), num_nodes=int(cfg.trainer.num_nodes))
    return Cluster(**fields)


def planner_inputs(cfg: DictConfig, run: ResolvedRun) -> tuple[Any, Any, Any]:
    """``(shape, layout, workload)``: the run as the planner sees it (`strategies.planner.layout`).

    Raises:
        ConfigError: the model has no Llama-style shape (the planner models only those).
    """
    from strategies.mesh import build_strategy
    from strategies.planner.layout import layout_of, workload_of

    if run.shape is None:
        raise ConfigError(["the planner needs a Llama-style model (one with n_heads, n_layers, ...): model=tiny, llama3_8b, ..."])
    strategy = build_strategy(cfg.strategy, run=run)  # as trainer.build.build_strategy
    resolve_pipeline_split(cfg, run, strategy)
    workload = workload_of(run, strategy, float8=cfg.planner.float8, async_tp=cfg.planner.async_tp)
    return run.shape, layout_of(run, strategy), workload


def resolve_pipeline_split(cfg: DictConfig, run: ResolvedRun, strategy: Any) -> None:
    """Sets the pipeline split points of ``strategy`` (a built `MeshStrategy`) in place when
    ``strategy.pipeline.split=auto`` leaves them open and pp > 1: the planner's cost-balanced
    points (`strategies.planner.time.auto_split_points`) for the run's model, layout and sequence
    length on ``cfg.cluster`` (without one, the time model's defaults of the run's device:
    compute and memory traffic only). Otherwise leaves the strategy as it is (layer-count split)."""
    from strategies.planner.layout import layout_of, workload_of
    from strategies.planner.time import Cluster, auto_split_points

    pipeline = strategy.plugins.get("pipeline")
    if pipeline is None or pipeline.split != "auto" or pipeline.split_points is not None or run.dims.pp == 1:
        return
    if run.shape is None:
        return  # refused by PipelineParallel.problems
    if cfg.get("cluster") is not None:
        cluster = cluster_from_config(cfg)
    else:
        import torch

        gpu = str(cfg.trainer.accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        cluster = Cluster(device="cuda" if gpu else "cpu")
    float8, async_tp = (bool(OmegaConf.select(cfg, f"planner.{key}", default=False)) for key in ("float8", "async_tp"))
    workload = workload_of(run, strategy, float8=float8, async_tp=async_tp)
    pipeline.split_points = auto_split_points(run.shape, layout_of(run, strategy), workload, cluster)


def check_memory(cfg: DictConfig, run: ResolvedRun) -> None:
    """``planner.check``: predicted per-device peak memory of the run's layout against the cluster's cap.

    Raises:
        ConfigError: the prediction is over the cap (the message holds the breakdown), or no cluster.
    """
    from strategies.planner.memory import predict_memory
    from strategies.planner.report import oom_message

    cluster = cluster_from_config(cfg)
    shape, layout, workload = planner_inputs(cfg, run)
    memory = predict_memory(shape, layout, workload, device=cluster.device)
    if memory.total > cluster.memory_cap:
        raise ConfigError([oom_message(memory, cluster, layout.label())])


def _calibration_block() -> tuple[Any, tuple[Any, ...]]:
    """A tiny Llama block and its one-token inputs: the host time per layer the planner calibrates."""
    import torch

    from trainer.models.block import TransformerBlock
    from trainer.models.rope import rope_tables

    dim = 64
    cos, sin = rope_tables(dim // 4, 1, 10000.0)
    x = torch.randn(1, 1, dim, requires_grad=True)
    return TransformerBlock(dim, 4, 2, 192, 1e-5), (x, cos[None, :, None, :], sin[None, :, None, :], None)


def _calibration_model(vocab_size: int) -> Any:
    """A one-layer Llama (seeded) for the planner's tensor-parallel dispatch probe."""
    import torch

    from trainer.models.llama import Llama

    torch.manual_seed(0)
    return Llama(vocab_size=vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)


def calibrate(cluster: Any) -> Any:
    """``cluster`` with this machine's measured rates (`strategies.planner.calibrate`), probed with Llama blocks."""
    from strategies.planner.calibrate import calibrate_cluster

    return calibrate_cluster(cluster, block=_calibration_block(), model_fn=_calibration_model)


def plan(cfg: DictConfig, run: ResolvedRun) -> str:
    """The ranked table and the best layout's overrides for a composed config and its resolved run."""
    from strategies.planner.report import best_overrides, table
    from strategies.planner.search import SearchSpace, search

    from strategies.planner.calibrate import calibration_problem

    cluster = cluster_from_config(cfg)
    if cfg.planner.calibrate:
        if (problem := calibration_problem(cluster)) is not None:
            raise ConfigError([problem])  # before any probe forks a process
        cluster = calibrate(cluster)
    p = cfg.planner
    space = SearchSpace(
        schedules=tuple(p.schedules), cp_modes=tuple(p.cp_modes), ac_modes=tuple(p.ac_modes),
        offload=p.offload, max_micro_batch=p.max_micro_batch, hsdp=p.hsdp,
    )  # fmt: skip
    shape, _, workload = planner_inputs(cfg, run)
    plans = search(shape, workload, cluster, space)
    header = f"cluster {cluster.name}: " + (
        "calibrated on this machine" if cfg.planner.calibrate else "preset figures (planner.calibrate=true measures them)"
    )
    return "\n".join([header, table(plans, cluster, top=p.top), best_overrides(plans, cluster)])


def main(argv: list[str]) -> None:
    """Entry of ``plait plan``: compose like a run, validate, print the plan; exit 2 on bad config."""
    from trainer.compose import compose, fail, split_recipe
    from trainer.config import validate
    from trainer.targets import UntrustedTargetError

    recipe, overrides = split_recipe(argv)
    try:
        cfg = compose(recipe, overrides)
        print(plan(cfg, validate(cfg)))
    except ConfigError as err:
        fail("invalid configuration:\n" + "\n".join(f"  - {p}" for p in err.problems))
    except UntrustedTargetError as err:  # model.init_from's run names code outside plait: nothing of it was built
        fail(str(err))
    except Exception as err:  # noqa: BLE001 - Hydra's override errors: one line, like a run
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            fail(str(err).strip().splitlines()[0])
        raise
    sys.stdout.flush()
