"""The planner (`strategies.planner`) on a composed run: its inputs, the memory check
(``planner.check``, before a launch) and the ranked layouts of ``plait plan``.

The config is the run's (composed and validated as for training); ``cluster=`` names the
machine. The pipeline's split points are a fact of the resolved run (`ResolvedRun.pp_split_points`,
resolved by `trainer.semantics.resolve`), so nothing here changes a built object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.mesh import build_strategy
from strategies.planner.calibrate import calibrate_cluster, calibration_problem
from strategies.planner.layout import Layout, Workload, layout_of, workload_of
from strategies.planner.memory import GiB, predict_memory
from strategies.planner.report import best_overrides, oom_message, table
from strategies.planner.search import Plan, SearchSpace, evaluate, search
from strategies.planner.time import Cluster
from trainer.config import ConfigError, validate
from trainer.models.block import TransformerBlock
from trainer.models.llama import Llama
from trainer.models.rope import rope_tables
from trainer.semantics import cluster_of


def cluster_from_config(cfg: DictConfig) -> Cluster:
    """The `Cluster` of ``cfg.cluster``; a CPU preset takes its ranks from trainer.devices/num_nodes.

    Raises:
        ConfigError: no cluster selected.
    """
    cluster = cluster_of(cfg)
    if cluster is None:
        raise ConfigError(
            ["the planner needs a machine: add cluster=<preset> (conf/cluster/: h100x8, h100x64, cpu, ...)"]
        )
    return cluster


def planner_inputs(cfg: DictConfig, run: ResolvedRun) -> tuple[ModelShape, Layout, Workload]:
    """``(shape, layout, workload)``: the run as the planner sees it (`strategies.planner.layout`).

    Raises:
        ConfigError: the model has no Llama-style shape (the planner models only those).
    """
    if run.shape is None:
        raise ConfigError(
            ["the planner needs a Llama-style model (one with n_heads, n_layers, ...): model=tiny, llama3_8b, ..."]
        )
    strategy = build_strategy(cfg.strategy, run=run)  # its plugins' knobs (as trainer.build.build_strategy)
    workload = workload_of(run, strategy, float8=cfg.planner.float8, async_tp=cfg.planner.async_tp)
    return run.shape, layout_of(run, strategy, workload), workload


def check_memory(cfg: DictConfig, run: ResolvedRun) -> None:
    """``planner.check``: predicted per-device peak memory of the run's layout against the cluster's cap.

    Raises:
        ConfigError: the prediction is over the cap (the message holds the breakdown), or no cluster.
    """
    cluster = cluster_from_config(cfg)
    shape, layout, workload = planner_inputs(cfg, run)
    memory = predict_memory(shape, layout, workload, device=cluster.device)
    if memory.total > cluster.memory_cap:
        raise ConfigError([oom_message(memory, cluster, layout.label())])


def _calibration_block() -> tuple[Any, tuple[Any, ...]]:
    """A tiny Llama block and its one-token inputs: the host time per layer the planner calibrates."""
    dim = 64
    cos, sin = rope_tables(dim // 4, 1, 10000.0)
    x = torch.randn(1, 1, dim, requires_grad=True)
    return TransformerBlock(dim, 4, 2, 192, 1e-5), (x, cos[None, :, None, :], sin[None, :, None, :], None)


def _calibration_model(vocab_size: int) -> Any:
    """A one-layer Llama (seeded) for the planner's tensor-parallel dispatch probe."""
    torch.manual_seed(0)
    return Llama(vocab_size=vocab_size, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)


def calibrate(cluster: Cluster) -> Cluster:
    """``cluster`` with this machine's measured rates (`strategies.planner.calibrate`), probed with Llama blocks."""
    return calibrate_cluster(cluster, block=_calibration_block(), model_fn=_calibration_model)


def plan(cfg: DictConfig, run: ResolvedRun) -> str:
    """The ranked table and the best layout's overrides for a composed config and its resolved run.

    Raises:
        ConfigError: no cluster, a model without a Llama-style shape, or ``planner.calibrate``
            where this machine cannot calibrate.
    """
    cluster = cluster_from_config(cfg)
    if cfg.planner.calibrate:
        if (problem := calibration_problem(cluster)) is not None:
            raise ConfigError([problem])  # before any probe forks a process
        cluster = calibrate(cluster)
    p = cfg.planner
    space = SearchSpace(
        schedules=tuple(p.schedules),
        cp_modes=tuple(p.cp_modes),
        ac_modes=tuple(p.ac_modes),
        offload=p.offload,
        max_micro_batch=p.max_micro_batch,
        hsdp=p.hsdp,
    )
    shape, configured, workload = planner_inputs(cfg, run)
    plans = search(shape, workload, cluster, space, kept=configured)
    refused = refused_until(plans, LayoutCheck(cfg, cluster), top=p.top)
    plans = [plan for plan in plans if plan.layout not in refused]
    header = f"cluster {cluster.name}: " + (
        "calibrated on this machine"
        if cfg.planner.calibrate
        else "preset figures (planner.calibrate=true measures them)"
    )
    lines = [header, table(plans, cluster, top=p.top)]
    if refused:
        (first, problem), n = next(iter(refused.items())), len(refused)
        lines.append(
            f"{n} faster layout{'s' * (n > 1)} left out: validate refuses {'them' if n > 1 else 'it'} with this "
            f"config (the first, {first.label()}: {problem})"
        )
    lines.append(best_overrides(plans, cluster, configured))
    if configured.world_size == cluster.world_size:  # the command line's own layout, on this cluster
        lines.append(configured_line(evaluate(shape, configured, workload, cluster), plans, cluster))
    return "\n".join(lines)


class LayoutCheck:
    """What validate says of a searched layout: the run's config with ``strategy=nd``'s local SGD and
    fault tolerance (none), the cluster's devices and the layout's settings (`Layout.settings`), as
    the command line with the plan's printed overrides composes it.

    Verdicts are kept per layout up to its activation checkpointing and offload, which no check
    reads (`ActivationCheckpoint.problems` and `ActivationOffload.problems` find none): about 60 ms
    of validate each at Llama 3 8B, so the plan checks only the layouts it shows."""

    def __init__(self, cfg: DictConfig, cluster: Cluster) -> None:
        self.base = copy.deepcopy(cfg)
        with open_dict(self.base):
            self.base.strategy.local_sgd = None
            self.base.strategy.fault_tolerance = None
            self.base.trainer.devices, self.base.trainer.num_nodes = cluster.devices_per_node, cluster.num_nodes
        self._verdicts: dict[Layout, str | None] = {}

    def __call__(self, layout: Layout) -> str | None:
        """validate's first problem with ``layout``, or None when it accepts it."""
        key = layout.with_(ac="none", ac_every_k=1, activation_offload=False)
        if key not in self._verdicts:
            cfg = copy.deepcopy(self.base)
            for name, value in layout.settings().items():
                OmegaConf.update(cfg, name, value, merge=False)
            try:
                validate(cfg, for_launch=False)
                self._verdicts[key] = None
            except ConfigError as err:
                self._verdicts[key] = err.problems[0]
        return self._verdicts[key]


def refused_until(plans: list[Plan], check: Callable[[Layout], str | None], *, top: int) -> dict[Layout, str]:
    """The fitting layouts validate refuses (each with its first problem), in rank order, checked
    until ``top`` of them are accepted: the rows a plan shows and its best line all train."""
    refused: dict[Layout, str] = {}
    accepted = 0
    for plan in plans:
        if accepted == top or not plan.fits:
            break
        if (problem := check(plan.layout)) is None:
            accepted += 1
        else:
            refused[plan.layout] = problem
    return refused


def configured_line(mine: Plan, plans: list[Plan], cluster: Cluster) -> str:
    """The command line's own layout against the search: its prediction and its place among the
    layouts that fit (a layout the search does not try, e.g. local SGD's islands, is placed by time)."""
    fitting = [p for p in plans if p.fits]
    what = f"your layout: {mine.layout.label()}, predicted {mine.tokens_per_s:.4g} tokens/s per device, "
    if not mine.fits:
        return what + f"{mine.memory.total / GiB:.2f} GiB: over the {cluster.memory_cap / GiB:.1f} GiB per device"
    place = 1 + sum(p.time.total < mine.time.total for p in fitting if p.layout != mine.layout)
    searched = any(p.layout == mine.layout for p in fitting)  # else it joins them (a layout the search does not try)
    return what + f"{mine.memory.total / GiB:.2f} GiB: #{place} of the {len(fitting) + (not searched)} that fit"
