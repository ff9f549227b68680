"""From a ``strategy:`` config node to a strategy's parts: the plugins in the order every phase
walks them (``ORDER``, completed with ``DEFAULTS``), the degrees, plugins and settings of the node
(`split_node`) and the checks of `strategies.mesh.MeshStrategy`'s own settings.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, get_args

from hydra.utils import instantiate

from strategies.activation_checkpoint import ActivationCheckpoint
from strategies.activation_offload import ActivationOffload
from strategies.compile import Compile
from strategies.context.plugin import ContextParallel
from strategies.core.parallel_dims import MESH_AXES, ParallelDims
from strategies.expert.plugin import ExpertParallel
from strategies.float8 import Float8
from strategies.fsdp import FSDP
from strategies.moved_keys import MOVED_KEYS  # refused by validate, naming the new key
from strategies.pipeline.plugin import PipelineParallel
from strategies.plugin import StrategyPlugin
from strategies.runtime.host_allocator import CPUAllocator
from strategies.runtime.watchdog import Heartbeat
from strategies.tensor import TensorParallel

if TYPE_CHECKING:
    pass

# The order every phase walks the plugins in (later techniques wrap what earlier ones produced):
# float8 first (it swaps the Linear modules of the whole model for float8 ones under the same names,
# which every later technique then splits, shards and wraps as it would the plain ones; FSDP then
# all-gathers their weights in float8), the pipeline split (each rank keeps its stages; the others
# then work on fewer layers), tensor parallel (DTensor-shards the Linear weights), context-parallel
# attention (its core sees the tp rank's heads of its cp shard), expert parallelism (an MoE block
# sees its rank's tokens; the experts get their own FSDP, which the blocks' FSDP then leaves alone),
# LoRA (its adapters take the placements of the tensor-parallel base weights; its hooks run inside
# every later wrapper), activation offload (hooks around each block, kept by the checkpointed
# forward), activation checkpointing (the recomputed forward is the TP/CP one), compile (each
# compiled block graph holds the checkpoint), FSDP (shards whatever parameters the others left, each
# pipeline stage its own root; its hooks stay outside the checkpointed function), SAT (finds the
# MLPs it works on in each step), then local SGD and Mixout (in `setup`: they keep the parameter
# objects the optimizer holds, and their anchors are the weights training starts from). Plugins of
# other keys come after, in node order.
ORDER = (
    "float8",
    "pipeline",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "lora",
    "activation_offload",
    "activation_checkpoint",
    "compile",
    "fsdp",
    "sat",
    "local_sgd",
    "mixout",
)
# The plugins a strategy built by hand holds when not given (each is off, or inactive, by default).
DEFAULTS: dict[str, type[StrategyPlugin]] = {
    "float8": Float8, "pipeline": PipelineParallel, "tensor_parallel": TensorParallel,
    "context_parallel": ContextParallel, "expert_parallel": ExpertParallel, "activation_offload": ActivationOffload,
    "activation_checkpoint": ActivationCheckpoint, "compile": Compile, "fsdp": FSDP,
}  # fmt: skip


def check_settings(*, timeout_s: float, heartbeat_s: float, launcher: str, cpu_allocator: str) -> None:
    """Checks `MeshStrategy`'s own settings.

    Raises:
        ValueError: an unknown ``launcher`` or ``cpu_allocator``, or ``heartbeat_s >= timeout_s``.
    """
    if launcher not in ("subprocess", "fork"):
        raise ValueError(f"strategy.launcher={launcher!r} is unknown; use subprocess or fork")
    if cpu_allocator not in get_args(CPUAllocator):
        raise ValueError(
            f"strategy.cpu_allocator={cpu_allocator!r} is unknown; use {' or '.join(get_args(CPUAllocator))}"
        )
    if heartbeat_s >= timeout_s:
        raise ValueError(
            f"strategy.heartbeat_s={heartbeat_s:g} must be below strategy.timeout_s={timeout_s:g} (a stalled rank is "
            "named before its collective times out); lower heartbeat_s (0 disables it)"
        )


def ordered_plugins(plugins: Mapping[str, StrategyPlugin | None], order: Sequence[str]) -> dict[str, StrategyPlugin]:
    """``plugins`` (a None one: not given) completed with `DEFAULTS` for the keys not given, in
    ``order`` (keys it does not list last, as given)."""
    given = {key: plugin for key, plugin in plugins.items() if plugin is not None}
    given = {**{key: make() for key, make in DEFAULTS.items() if key not in given}, **given}
    rank = {key: i for i, key in enumerate(order)}
    return dict(sorted(given.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def heartbeat_of(heartbeat_s: float, timeout_s: float) -> Heartbeat | None:
    """The watchdog of ``strategy.heartbeat_s`` (None: 0, off); a stalled rank aborts at ``timeout_s``."""
    if not heartbeat_s:
        return None
    return Heartbeat(stale_s=heartbeat_s, interval_s=min(5.0, heartbeat_s / 4), abort_s=timeout_s)


def split_node(cls: type, node: Mapping[str, Any]) -> tuple[ParallelDims, dict[str, Any], dict[str, Any]]:
    """``(degrees, plugins, settings)`` of a ``strategy:`` config node for the class ``cls``: the
    degrees (``dp_replicate`` ... ``pp``), the plugin nodes (a mapping with ``_target_``, built;
    null: off) and the rest, arguments of ``cls``.

    Raises:
        ValueError: a moved key (naming its new key), or a value neither a plugin nor a setting.
    """
    values = {str(k): v for k, v in node.items() if not (str(k).startswith("_") and str(k).endswith("_"))}
    if moved := [
        f"strategy.{k} is now strategy.{MOVED_KEYS[k]}; use strategy.{MOVED_KEYS[k]}={values[k]}"
        for k in MOVED_KEYS
        if k in values
    ]:
        raise ValueError("\n".join(moved))
    degrees = {axis: values.pop(axis) for axis in MESH_AXES if axis in values}
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    plugins: dict[str, StrategyPlugin | None] = {}
    for key, value in list(values.items()):
        if isinstance(value, Mapping) and "_target_" in value:
            plugins[key] = instantiate(value)
        elif value is None and key not in params:
            plugins[key] = None
        elif key in ("dims", "plugins") or key not in params and not takes_any:
            raise ValueError(
                f"strategy.{key}={value!r} is neither a plugin node (a mapping with _target_) nor a setting of {cls.__name__}"
            )
        else:
            continue
        del values[key]
    return ParallelDims(**degrees), plugins, values
