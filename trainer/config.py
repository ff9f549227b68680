"""The root config schema and `validate(cfg)`: every problem at once, each naming its fix.

Pluggable objects are ``_target_`` + kwargs nodes whose class signature is their schema; the
run-wide fields are the dataclasses below. `validate` never mutates the composed config.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, InterpolationToMissingValueError

from strategies.core.parallel_dims import MESH_AXES, ParallelDims
from strategies.core.ranges import NON_NEGATIVE, POSITIVE, Range
from strategies.core.resolved import ResolvedRun
from strategies.moved_keys import MOVED_KEYS
from trainer.combinations import driver_problems, island_bias_problems, subnet_problems, target_class
from trainer.contracts import callback_problem, objective_problems, strategy_problem
from trainer.model_node import NODE_KEYS
from trainer.node_schema import check_dataclass, check_target, type_ok
from trainer.optim import DEFAULT_NO_DECAY
from trainer.semantics import check_semantics


class ConfigError(ValueError):
    """An invalid configuration. ``problems`` holds one message per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class TrainConfig:
    """How one run trains, independent of the parallel layout.

    Attributes:
        global_batch_size: rows per optimizer step over all data-parallel ranks.
        micro_batch_size: rows per forward/backward on one rank; grad_accum =
            global_batch_size / (micro_batch_size x dp). null: all of the rank's rows at once (with
            pp > 1: one row per pipeline micro-batch).
        max_grad_norm: clip the global gradient norm to this (0 or null: no clipping).
        no_decay: substrings of parameter names that get no weight decay.
        eval_every: evaluate every this many steps (plus step 0 and the last step; 0: only those).
        nonfinite: an anomalous step (its loss or gradient norm NaN, inf, or a spike) skips its
            update, decided before the optimizer step; "stop" also stops the run after
            ``max_nonfinite_steps`` such steps in a row (exit 3); "rollback" there reloads the
            weights and optimizer state of the checkpoint from before the first of them and goes on
            with the data after them (at most ``max_rollbacks`` times, then it stops); "skip" goes
            on until more than ``max_skipped_steps`` steps were skipped. The stop message names the
            checkpoint from before the first anomalous step (kept from pruning until the run
            recovers).
        max_nonfinite_steps: anomalous steps in a row that stop the run under ``nonfinite=stop``.
        max_skipped_steps: skipped steps of the whole run that ``nonfinite=skip`` tolerates; the
            next one stops the run (exit 3). summary.json says how many were skipped.
        max_rollbacks: checkpoint reloads of the whole run under ``nonfinite=rollback``; the next
            anomaly that would need one stops the run (exit 3) with the same advice as ``stop``.
        spike_factor: a step spikes when its loss or gradient norm is above this factor x the
            largest of the last ``spike_window`` admitted steps, or its gradient norm below their
            smallest / this factor (`trainer.spikes`); 0 turns the spike rule off.
        spike_window: admitted steps the spike rule compares with; also the admitted steps in a
            row after which a run has recovered from an anomaly.
    """

    global_batch_size: int = 8
    micro_batch_size: int | None = None
    max_grad_norm: Annotated[float, NON_NEGATIVE] | None = 1.0
    no_decay: list[str] = field(default_factory=lambda: list(DEFAULT_NO_DECAY))
    eval_every: int = 50
    nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    max_nonfinite_steps: Annotated[int, POSITIVE] = 3
    max_skipped_steps: Annotated[int, NON_NEGATIVE] = 10
    max_rollbacks: Annotated[int, NON_NEGATIVE] = 2
    spike_factor: Annotated[float, NON_NEGATIVE] = 10.0
    spike_window: Annotated[int, POSITIVE] = 20


@dataclass
class TrainerConfig:
    """The Lightning ``Trainer`` arguments plait exposes (others are set by plait itself)."""

    # The accelerators plait's strategy (Lightning's ModelParallelStrategy) runs on.
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: Annotated[int, POSITIVE] = 1
    num_nodes: Annotated[int, POSITIVE] = 1
    # The precisions Lightning's ModelParallelStrategy accepts.
    precision: Literal["32-true", "bf16-mixed", "bf16-true", "16-true"] = "32-true"
    max_steps: int = 200
    log_every_n_steps: Annotated[int, POSITIVE] = 10
    limit_train_batches: float | int | None = None
    enable_progress_bar: bool = True
    deterministic: bool | str = False


@dataclass
class PlannerConfig:
    """The layout planner (``plait plan``, strategies.planner) and its pre-launch memory check.

    Attributes:
        check: before a run starts, predict its per-device peak memory on ``cluster`` and fail
            when it is over the cap, with the predicted breakdown.
        calibrate: ``plait plan`` measures this machine first (matmul FLOP/s, memory and gloo
            bandwidth, dispatch overhead) and plans with the measured figures.
        top: rows of the ranked table.
        schedules, cp_modes, ac_modes: pipeline schedules, context-parallel modes and activation
            checkpointing modes (none, every_2, full) searched.
        offload: also search activation offload.
        max_micro_batch: largest micro-batch size searched.
        hsdp: also search dp_replicate > 1.
        float8, async_tp: kernels the time model assumes (torchtitan's), what-ifs of ``plait plan``: a run
            with strategy.float8.recipe set is planned with float8 matmuls without planner.float8.
    """

    check: bool = False
    calibrate: bool = False
    top: int = 10
    schedules: list[str] = field(default_factory=lambda: ["1F1B", "Interleaved1F1B", "ZBV"])
    cp_modes: list[str] = field(default_factory=lambda: ["ring", "ulysses"])
    ac_modes: list[str] = field(default_factory=lambda: ["none", "every_2", "full"])
    offload: bool = False
    max_micro_batch: int = 8
    hsdp: bool = True
    float8: bool = False
    async_tp: bool = False


@dataclass
class RunConfig:
    """Root of every recipe.

    Attributes:
        recipe: the recipe's name (names the default run directory).
        run_dir: where this run writes config, checkpoints, logs and summary.
        seed: global seed (model init, data split and shuffle).
        resume: "last" (newest checkpoint of run_dir), or a checkpoint / run directory path.
        resume_override: fields a resume may change from the checkpoint's run (``optim``,
            ``scheduler``, ``train.max_grad_norm`` or keys under them; `trainer.resume`).
        trust: packages besides plait whose classes the ``config.yaml`` of the run
            ``model.init_from`` names may build (`trainer.targets.check_targets`; ``generate``'s
            ``trust`` likewise).
        objective, model, data, optim, scheduler, strategy: ``_target_`` nodes.
        budget: an optional ``_target_`` node of a budget search (``budget=msft``) that drives runs.
        rest: an optional ``_target_`` node of self-training rounds (``plait rest``) that drive runs;
            each round writes its own ``data.sources`` (`trainer.rest.driver`).
        logger: named ``_target_`` nodes of Lightning loggers.
        callbacks: named ``_target_`` nodes of Lightning callbacks.
        cluster: a machine preset (``cluster=h100x8``, conf/cluster/) for the planner.
        planner: the layout planner's settings (`PlannerConfig`).
    """

    recipe: str = "???"  # required: every recipe names itself
    run_dir: str = "runs/${recipe}/${now:%Y-%m-%d_%H-%M-%S}"
    seed: Annotated[int, Range(min=0, max=2**32 - 1)] = 0  # NumPy's seed range
    resume: str | None = None
    resume_override: list[str] = field(default_factory=list)
    trust: list[str] = field(default_factory=list)
    objective: Any = None
    model: Any = None
    data: Any = None
    optim: Any = None
    scheduler: Any = None
    strategy: Any = None
    logger: Any = None
    callbacks: Any = None
    budget: Any = None
    rest: Any = None
    cluster: Any = None
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# Arguments the trainer passes itself when it builds each object (not set in YAML).
INJECTED = {
    "model": {"vocab_size"},
    "data": {"run"},
    "optim": {"params"},
    "scheduler": {"optimizer", "total_steps", "last_epoch"},
    "strategy": {"launcher"},
}
# Keys plait reads itself off a node, passed to its target only when the target takes them
# (`trainer.model_node`: ``model.init_from``, loaded by the Task, not by the model).
OWN_KEYS = {"model": NODE_KEYS}
TARGET_NODES = ("objective", "model", "data", "optim", "scheduler", "strategy", "budget", "rest")
# The groups whose class validate asks for its own problems (`trainer.protocols.Component`); the
# data module's evaluators are asked too (`DataModule.evaluator_types`), and the strategy asks its
# plugins (`MeshStrategy.problems`, in `trainer.semantics.resolve`).
COMPONENT_GROUPS = ("objective", "data", "rest")


def component_problems(cfg: DictConfig, run: ResolvedRun | None) -> list[str]:
    """Each component's own problems: ``cls.problems(run, node)`` of the objective's and the data
    module's class, of each evaluator class the data module builds (given the data node), and of
    each callback class that has one.

    ``run`` is None when the layout did not resolve. A node whose ``_target_`` does not import is
    skipped (the target checks report it). The data node of ``plait rest`` is checked by each
    round's own launch, once the round has written its sources (`trainer.rest.driver`)."""
    problems: list[str] = []
    for group in COMPONENT_GROUPS:
        node = cfg.get(group)
        if group == "data" and cfg.get("rest") is not None:
            continue
        if (cls := target_class(node)) is None:
            continue
        if group == "objective" and (broken := objective_problems(cls)):
            problems.extend(broken)
            continue
        components = [cls, *cls.evaluator_types(node)] if group == "data" else [cls]
        for component in components:
            problems.extend(component.problems(run, node))
    problems.extend(driver_problems(cfg))
    problems.extend(subnet_problems(cfg))
    problems.extend(island_bias_problems(cfg))
    data_cls, budget_cls = target_class(cfg.get("data")), target_class(cfg.get("budget"))
    if data_cls is not None and callable(check := getattr(budget_cls, "data_problems", None)):
        problems.extend(check(data_cls))  # a budget search drives runs of one kind of data
    callbacks = cfg.get("callbacks")
    for key, node in callbacks.items() if isinstance(callbacks, DictConfig) else ():
        if (cls := target_class(node)) is not None and (problem := callback_problem(cls, f"callbacks.{key}")):
            problems.append(problem)
        elif callable(check := getattr(cls, "problems", None)):  # a callback may say what keeps it from running
            problems.extend(check(run, node))
    return problems


def validate(cfg: DictConfig, *, for_launch: bool = True) -> ResolvedRun:
    """Checks a composed config before anything is launched or written; returns its resolved run.

    The returned `ResolvedRun` (degrees, micro-batches, the model's shape, ...) is what the
    builders, the strategy, its plugins, the planner and the data modules receive: call this once
    per launch and pass the result on.

    Args:
        for_launch: False for a config that is only planned (``plait plan``): what only a launch
            needs, such as LoRA's base (``model.init_from``), is not asked for.

    Raises:
        ConfigError: listing every problem found, each with the override that fixes it.
    """
    problems: list[str] = _interpolation_problems(cfg)
    if problems:  # every later check reads these values
        raise ConfigError(problems)
    check_dataclass(cfg, RunConfig, "", problems)
    for name in TARGET_NODES:
        if name in cfg and cfg[name] is not None:
            if name == "strategy" and isinstance(cfg.strategy, DictConfig):
                _check_strategy(cfg.strategy, problems)
                continue
            check_target(cfg[name], name, problems, injected=INJECTED.get(name, set()), own=OWN_KEYS.get(name, ()))
    if "strategy" in cfg and isinstance(cfg.strategy, DictConfig):
        for key, plugin in cfg.strategy.items():  # fsdp, activation_checkpoint, compile, ...
            if isinstance(plugin, DictConfig) and "_target_" in plugin:
                check_target(plugin, f"strategy.{key}", problems)
    for group in ("logger", "callbacks"):
        node = cfg.get(group)
        if isinstance(node, DictConfig):
            for key, sub in node.items():
                if sub is not None:
                    check_target(sub, f"{group}.{key}", problems, injected={"save_dir", "dirpath"})
    run = None
    if not problems:
        run = check_semantics(cfg, problems, for_launch=for_launch)
        problems += component_problems(cfg, run)
    else:
        # Every problem at once: check the semantics too, with mistyped run-wide fields at their
        # defaults (and no message about those fields, which are already reported).
        replaced: list[str] = []
        semantic: list[str] = []
        broken = frozenset(p.removeprefix("unknown key ").split(".")[0].split("=")[0] for p in problems)
        try:
            typed = _well_typed(cfg, replaced)
            semantic += component_problems(typed, check_semantics(typed, semantic, broken, for_launch=for_launch))
        except Exception:  # noqa: BLE001 - a broken object node (already reported) stops these checks
            pass
        problems += [p for p in semantic if not any(f"{name}=" in p for name in replaced)]
    if problems:
        raise ConfigError(problems)
    assert run is not None  # every config without problems resolves
    return run


def _interpolation_problems(node: Any, prefix: str = "") -> list[str]:
    """One message per ``${...}`` of ``node`` that does not resolve: a group of another recipe
    (``plait sft data=stream``: the objective's ``${oc.dict.keys:data.sources}``) or a removed key."""
    problems: list[str] = []
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node)) if isinstance(node, ListConfig) else ()
    for key in keys:
        where = f"{prefix}{key}" if isinstance(key, str) else f"{prefix.rstrip('.')}[{key}]"
        if not prefix and key == "hydra":
            continue
        child = node._get_node(key)
        if child is not None and child._is_interpolation():
            try:
                node[key]
            except InterpolationToMissingValueError:  # a ??? value: reported where it is missing
                continue
            except InterpolationResolutionError as err:
                cause = str(err).splitlines()[0].split("resolving interpolation: ")[-1]
                problems.append(
                    f"{where}={child._value()} does not resolve ({cause}): a group of another recipe? "
                    "`plait <recipe> --help` lists each group's choices"
                )
                continue
        if isinstance(child, (DictConfig, ListConfig)):
            problems += _interpolation_problems(child, f"{where}.")
    return problems


def _well_typed(cfg: DictConfig, replaced: list[str]) -> DictConfig:
    """A copy of ``cfg`` whose run-wide fields that fail their type hold their defaults; their
    dotted names are appended to ``replaced``."""
    cfg = copy.deepcopy(cfg)

    def fix(node: Any, schema: type, prefix: str) -> None:
        if not isinstance(node, DictConfig):
            return
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if f.name not in node:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                fix(node[f.name], hints[f.name], f"{prefix}{f.name}.")
            elif not type_ok(OmegaConf.select(node, f.name, throw_on_missing=False), hints[f.name]):
                node[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                replaced.append(f"{prefix}{f.name}")

    fix(cfg, RunConfig, "")
    return cfg


# What `strategies.mesh.MeshStrategy.from_node` passes its class itself (not settings of the node).
STRATEGY_OWN = frozenset({"dims", "plugins", "run", "launcher"})


def _check_strategy(node: DictConfig, problems: list[str]) -> None:
    """The ``strategy`` node as `strategies.mesh.MeshStrategy.from_node` splits it: its degrees
    against `ParallelDims`, its plugin nodes (null: off; each checked on its own), and the rest
    against the ``_target_`` class's signature; a moved key names its new key."""
    plugins = {
        str(k) for k, v in node.items_ex(resolve=False) if v is None or isinstance(v, DictConfig) and "_target_" in v
    }
    problems += [
        f"strategy.{old} is now strategy.{new}; use strategy.{new}={node[old]}"
        for old, new in MOVED_KEYS.items()
        if old in node
    ]
    check_dataclass(
        OmegaConf.masked_copy(node, [a for a in MESH_AXES if a in node]), ParallelDims, "strategy.", problems
    )
    if (cls := target_class(node)) is not None and (problem := strategy_problem(cls)):
        problems.append(problem)
        return
    settings = OmegaConf.masked_copy(node, [str(k) for k in node if k not in {*MESH_AXES, *MOVED_KEYS, *plugins}])
    check_target(settings, "strategy", problems, injected=STRATEGY_OWN)
