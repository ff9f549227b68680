"""What every local-SGD plugin shares: islands, the step counter, exact byte accounting, checkpoints.

Islands are the ``dp_replicate`` mesh axis. Inside an island FSDP (dp_shard), TP, CP and PP
synchronise every step as usual; across islands only these plugins communicate, on the
``dp_replicate`` process group: the rank at one (pp, dp_shard, cp, tp) position of each island talks
to the ranks at the same position of the others, which hold the same shards. Each island divides
its loss by its own supervised-token count (`MeshStrategy.token_axis`); the logged train loss is
the token-weighted mean over all islands. A validation between two synchronisations evaluates each
island's parameters on its own rows (the logged figure is again the token-weighted mean).

Bytes: an all-reduce of ``B`` bytes over ``n`` ranks is counted as ``2 (n - 1) / n * B`` bytes sent
by each rank (ring all-reduce: reduce-scatter then all-gather, the bandwidth-optimal algorithm).
DDP's per-step gradient all-reduce, counted the same way (`allreduce_bytes_sent`), makes the
ratios to DDP independent of the algorithm a backend really uses. Only cross-island traffic of the
algorithm is counted: traffic inside an island and the per-step scalars (token counts, logged loss)
are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.async_save import AsyncWriter
from strategies.core.local_shards import local
from strategies.core.parallel_dims import LayoutError, Meshes
from strategies.plugin import StrategyPlugin
from strategies.runtime.collective_device import collective_device

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


def allreduce_bytes_sent(num_bytes: int, num_ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a ``num_bytes`` message over ``num_ranks`` ranks."""
    return 2.0 * (num_ranks - 1) / num_ranks * num_bytes if num_ranks > 1 else 0.0


@torch.no_grad()
def average_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> float:
    """Replaces each tensor (its local shard) by its mean over the ranks of ``group``, in place.

    One flat all-reduce (SUM, then divide: gloo has no AVG) per dtype, on the device ``group``'s
    backend serves (`strategies.runtime.collective_device`: host shards of FSDP's CPU offload go to the GPU
    of an NCCL-only group and back). Every rank of ``group`` must pass tensors of the same shapes
    in the same order.

    Returns:
        Bytes this rank sent (`allreduce_bytes_sent` of the flat messages); 0 for a group of one.
    """
    num_ranks = dist.get_world_size(group) if group is not None else 1
    if num_ranks == 1 or not tensors:
        return 0.0
    shards = [local(t) for t in tensors]
    sent = 0.0
    for flat, index in flat_messages(shards, group):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(num_ranks)
        for i, value in zip(index, torch.split(flat, [shards[i].numel() for i in index])):
            shards[i].copy_(value.view_as(shards[i]))
        sent += allreduce_bytes_sent(flat.numel() * flat.element_size(), num_ranks)
    return sent


def flat_messages(
    shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None, dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, list[int]]]:
    """One flat copy of ``shards`` per dtype (in the order the dtypes first appear), cast to ``dtype``
    when given, on the device ``group``'s backend serves (host shards under FSDP CPU offload go to the
    GPU of an NCCL-only group), each with the indices of the shards it holds, in order."""
    messages = []
    for source in dict.fromkeys(s.dtype for s in shards):
        index = [i for i, s in enumerate(shards) if s.dtype == source]
        flat = torch.cat([shards[i].reshape(-1) for i in index])
        flat = flat.to(collective_device(group, flat.device), dtype=dtype or flat.dtype)
        messages.append((flat, index))
    return messages


@dataclass(frozen=True)
class IslandCost:
    """What a local-SGD layout costs beside its islands' own steps, as the planner counts it
    (`strategies.planner`; the steady state: warm-ups and cool-downs that synchronise every step are
    not averaged in).

    Attributes:
        label: the algorithm and its periods, as a plan prints them (``diloco H=100``).
        exchanged: parameter-sized messages each rank all-reduces across the islands per inner step,
            on average, in units of its local parameters' bytes (DDP's gradient all-reduce every step
            is 1.0; DiLoCo's pseudo-gradient every H steps 1 / H).
        kept: parameter-sized tensors each rank keeps beside the model and its inner optimizer, in the
            same units (DiLoCo: its anchors and the outer optimizer's momentum, 2).
        overlapped: whether the exchanges run under the next steps' compute (DASO's delayed
            messages) rather than blocking after a step.
    """

    label: str
    exchanged: float
    kept: float = 0.0
    overlapped: bool = False


class LocalSGD(StrategyPlugin):
    """Base of the local-SGD plugins; a subclass implements `sync` (and saves what it adds).

    The plugin owns the dp_replicate axis (``islands``: FSDP and the token count stay inside one
    island). The strategy applies it in `setup` (``when``), once the model is parallelized and
    holds the weights training starts from; `after_step` runs `after_optimizer_step` after each
    inner optimizer step; it writes and reads the checkpoints (`checkpoint_io`), with its
    `state_dict` in every one. Select a subclass with
    ``strategy.local_sgd._target_``; override `sync` (or a subclass's ``outer_step``) to change
    the algorithm.

    Attributes:
        step: inner optimizer steps done.
        bytes_sent: bytes this rank sent to other islands so far (see the module docstring).
        num_islands, island: size of the dp_replicate axis and this rank's position on it.
        params: the trainable parameters by name (DTensor shards under FSDP).
    """

    when = "setup"  # its global parameters (DiLoCo's anchors) start from the weights training starts from
    islands = True

    def __init__(self) -> None:
        self.step = 0
        self.bytes_sent = 0.0
        self.group: dist.ProcessGroup | None = None
        self.num_islands, self.island = 1, 0
        self.params: dict[str, nn.Parameter] = {}
        # torchft replica groups (strategy.fault_tolerance) as the islands, one per group: their
        # `ReplicaGroups` averages across the groups (set by it, `StrategyPlugin.peers`); None: dp_replicate
        self.replica_groups: Any = None

    # Whether the algorithm runs with torchft replica groups as its islands (its averages through `average`).
    runs_across_replica_groups: ClassVar[bool] = False

    def average(self, tensors: Sequence[torch.Tensor]) -> tuple[float, bool]:
        """Each tensor's mean over the islands, in place (`average_`, or across the replica groups
        present); returns the bytes this rank sent and whether the mean is complete (a replica
        group lost during it leaves the tensors to be discarded)."""
        if self.replica_groups is not None:
            return self.replica_groups.average(tensors)
        return average_(tensors, self.group), True

    def setup(self, model: nn.Module, *, group: dist.ProcessGroup | None) -> None:
        """Binds the plugin to the parallelized ``model`` and the islands' process ``group``.

        Every island holds the same initial parameters (the model is built from one seed).
        """
        self.group = group
        self.num_islands = dist.get_world_size(group) if group is not None else 1
        self.island = dist.get_rank(group) if group is not None else 0
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Counts the inner step, synchronises what is due, and returns the step's byte metrics."""
        self.step += 1
        sent = self.sync(optimizer, self.step)
        self.bytes_sent += sent
        return {"comm/bytes_sent": sent, "comm/bytes_sent_total": self.bytes_sent}

    def cost(self, *, optimizer_states: int, param_bytes: int) -> IslandCost:
        """What the planner counts for this algorithm (`IslandCost`); ``optimizer_states``: the inner
        optimizer's parameter-sized states (AdamW 2), ``param_bytes``: bytes per parameter element
        (4 for fp32). The base's: an average of the parameters after
        every step, nothing kept (a subclass with another period or state overrides it)."""
        return IslandCost(label=type(self).__name__.lower(), exchanged=1.0)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors `cost`'s ``kept`` counts, as this rank holds them (`strategies.planner.measure`)."""
        return []

    def sync(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Synchronises what is due after inner step ``step`` (1-based); returns the bytes this rank sent."""
        raise NotImplementedError

    def apply(self, model: nn.Module, meshes: Meshes) -> None:
        """`setup` over the islands of ``meshes`` (its dp_replicate axis).

        Raises:
            LayoutError: fewer than 2 islands (a strategy built without validate).
        """
        if self.replica_groups is not None:  # the islands are replica groups, one world each
            self.setup(model, group=None)
            return
        if (islands := meshes["dp_replicate"].size()) < 2:
            raise LayoutError(
                f"strategy.local_sgd needs at least 2 islands but strategy.dp_replicate={islands}; "
                f"use more ranks or a smaller strategy.dp_shard, or set strategy.local_sgd=null"
            )
        self.setup(model, group=meshes.group("dp_replicate"))

    @staticmethod
    def period_line(total_steps: int, every: int, key: str) -> str | None:
        """The warning for a run whose planned steps end before its first synchronisation (every
        ``every`` steps, the setting ``key``), or between two: its islands are apart at the end (the
        last evaluation and the checkpoint hold each island's own weights); None when it ends on one."""
        if total_steps < every:
            return (
                f"warning: strategy.local_sgd.{key}={every} is longer than the run's {total_steps} planned steps: "
                f"the islands never synchronise; lower strategy.local_sgd.{key}"
            )
        if total_steps % every:
            return (
                f"warning: the run's {total_steps} planned steps end {total_steps % every} after its last "
                f"synchronisation (strategy.local_sgd.{key}={every}): the islands end apart; choose trainer.max_steps "
                f"as a multiple of {every}"
            )
        return None

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """`after_optimizer_step`."""
        return self.after_optimizer_step(optimizer)

    def checkpoint_io(self) -> "LocalSGD":
        """This plugin: each island's state and its own (`save_checkpoint`, `load_checkpoint`)."""
        return self

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Configuration problems (each naming its fix) of the run's degrees, its inner optimizer
        (``run.optimizer``) and the model; [] when the run can start."""
        if self.replica_groups is not None:
            if not self.runs_across_replica_groups:
                return [
                    f"strategy.local_sgd ({type(self).__name__}) does not run across torchft replica groups yet; "
                    "use strategy=ft_diloco (DiLoCo) or strategy.fault_tolerance=null"
                ]
            if run.dims.dp_replicate > 1:
                return [
                    f"strategy.dp_replicate={run.dims.dp_replicate} with replica groups as the islands; use "
                    "strategy.dp_replicate=1 (one island per group: strategy.fault_tolerance.num_replica_groups)"
                ]
            return []
        if run.dims.dp_replicate >= 2:
            return []
        others = [
            f"strategy.{a}={getattr(run.dims, a)}" for a in ("dp_shard", "cp", "tp", "pp") if getattr(run.dims, a) > 1
        ]
        taken = f" (the {run.world_size} ranks go to {' x '.join(others)})" if others else f" ({run.world_size} rank)"
        return [
            f"strategy.local_sgd needs at least 2 islands but strategy.dp_replicate={run.dims.dp_replicate}{taken}; "
            f"use more ranks (trainer.devices){' or smaller degrees' if others else ''}, or set strategy.local_sgd=null"
        ]

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        path: Path,
        *,
        model: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        meta: dict[str, Any],
        writer: AsyncWriter | None = None,
    ) -> None:
        """`strategies.checkpoint.dcp.save` with this island's model and optimizer state under
        `checkpoint_namespace` and the plugin's `state_dict` under "local_sgd" (``writer``: in the background)."""
        ckpt.save(
            path,
            model=model,
            optimizers=optimizers,
            meta=meta,
            extra={"local_sgd": self.state_dict()},
            namespace=self.checkpoint_namespace(),
            writer=writer,
        )

    def load_checkpoint(
        self, path: Path, *, model: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """Loads a checkpoint written by `save_checkpoint` (same number of islands); returns its meta.

        Raises:
            CheckpointError: the checkpoint holds no local-SGD state for this island.
            ValueError: it was written by another number of islands (from `load_state_dict`).
        """
        saved = ckpt.saved_entries(path, prefix="local_sgd.")
        namespace = self.checkpoint_namespace()
        if not saved or (namespace is not None and not ckpt.saved_entries(path, prefix=f"{namespace}.")):
            raise ckpt.CheckpointError(
                f"{path} holds no local-SGD state for island {self.island} (written without strategy.local_sgd "
                f"or by fewer islands); resume it with the strategy and layout that wrote it"
            )
        extra = {"local_sgd": self.state_dict(saved)}
        meta = ckpt.load(path, model=model, optimizers=optimizers, extra=extra, namespace=namespace)
        self.load_state_dict(extra["local_sgd"])
        return meta

    def checkpoint_namespace(self) -> str | None:
        """Key under which this rank's model and inner-optimizer state are checkpointed.

        Islands differ between synchronisations, so each keeps its own copy: island 0 under the
        usual keys (what ``generate`` and ``model.init_from`` read), island k under
        ``local_sgd_island_k``.
        """
        return None if self.island == 0 else f"local_sgd_island_{self.island}"

    def state_dict(self, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The plugin's checkpoint state (DCP loads into it in place).

        Args:
            saved: when loading, the checkpoint's DCP metadata entries under this plugin's key
                (lets a subclass allocate state the checkpoint holds but this fresh run does not).
        """
        return {"step": self.step, "bytes_sent": self.bytes_sent, "num_islands": self.num_islands}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores counters from a loaded `state_dict`.

        Raises:
            ValueError: the checkpoint was written with another number of islands.
        """
        if int(state["num_islands"]) != self.num_islands:
            raise ValueError(
                f"the checkpoint was written by {state['num_islands']} local-SGD islands, this run has "
                f"{self.num_islands}; resume with strategy.dp_replicate={state['num_islands']}"
            )
        self.step, self.bytes_sent = int(state["step"]), float(state["bytes_sent"])
