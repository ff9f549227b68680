"""`MeshStrategy`: the one Lightning strategy for every layout, on one named N-D device mesh.

Lightning's `ModelParallelStrategy` stops at a 2-D (data, tensor) mesh and leaves parallelism to the
user's ``configure_model``. `MeshStrategy` builds the full (pp, dp_replicate, dp_shard, cp, tp) mesh
and runs each phase of its technique plugins (`strategies.plugin.StrategyPlugin`, in ``ORDER``):
their application to the model, this rank's micro-batches, the contexts of a step, the micro-batch
loop (or a plugin's schedule), the work after an optimizer step, and the checkpoint format (DCP,
resharded on load, unless a plugin owns it).

Subclass it, override one method, and select the subclass with ``strategy._target_=my_pkg.MyStrategy``.
A plugin of your own needs no subclass: a `StrategyPlugin` subclass and a ``strategy.<key>`` node
with its ``_target_`` (after the plugins of ``ORDER``, in the node's order).
"""

from __future__ import annotations

import functools
import inspect
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
import torch.distributed as dist
from hydra.utils import get_class
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.async_save import AsyncWriter
from strategies.context.placement import micro_batches_of
from strategies.core.parallel_dims import MESH_AXES, LayoutError, Meshes, ParallelDims
from strategies.core.ranges import NON_NEGATIVE, POSITIVE
from strategies.core.resolved import ResolvedRun
from strategies.core.shape import ModelShape
from strategies.grad_norm import clip_grads_, global_grad_norm
from strategies.meta_init import materialize
from strategies.plugin import Batch, LossFn, StrategyPlugin
from strategies.runtime.compute_timer import ComputeTimer
from strategies.runtime.host_allocator import CPUAllocator, keep_freed_host_memory
from strategies.runtime.launch import launcher_for
from strategies.strategy_node import ORDER, check_settings, heartbeat_of, ordered_plugins, split_node


class MeshStrategy(ModelParallelStrategy):
    """Builds the device mesh, parallelizes the model and runs the parallel parts of a step.

    Args:
        dims: the degrees (see `ParallelDims`; -1 fills the world); ``run.dims`` when ``run`` is given.
        plugins: the technique plugins by node key (None: off); the keys of `strategies.strategy_node.DEFAULTS` missing are
            their defaults. Walked in ``ORDER``, then the others in the given order.
        timeout_s: process-group timeout in seconds: a collective that waits longer fails.
        heartbeat_s: a rank silent this long is named by the others while they wait (0: off;
            `strategies.runtime.watchdog.Heartbeat`); below ``timeout_s``, which ends the run (exit 4).
        launcher: "subprocess" (the CLI: one child per rank per Hydra job) or "fork" (tests).
        cpu_allocator: on CPU, "keep_freed" (glibc keeps freed large blocks; `strategies.runtime.host_allocator`) or "system".
        run: the resolved run (`trainer.config.validate`; the builder passes it). None (built by
            hand): ``dims``, resolved for the world size when the processes start.

    `from_node` builds it from a ``strategy:`` config node (degrees, plugin nodes, settings).

    Raises:
        LayoutError: a degree > 1 on an axis whose technique this class does not apply.
        ValueError: an unknown ``launcher`` or ``cpu_allocator``, or ``heartbeat_s >= timeout_s``.
    """

    # Mesh axes the plugins apply (a degree > 1 on another would run the whole model on each of its
    # ranks: duplicated work, wrong cp gradients). A subclass that applies fewer lists them here.
    supported_axes: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    ORDER: ClassVar[tuple[str, ...]] = ORDER

    def __init__(
        self,
        dims: ParallelDims | None = None,
        plugins: Mapping[str, StrategyPlugin | None] | None = None,
        *,
        timeout_s: Annotated[float, POSITIVE] = 600.0,
        heartbeat_s: Annotated[float, NON_NEGATIVE] = 60.0,
        launcher: str = "subprocess",
        cpu_allocator: CPUAllocator = "keep_freed",
        run: ResolvedRun | None = None,
    ) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s))
        check_settings(timeout_s=timeout_s, heartbeat_s=heartbeat_s, launcher=launcher, cpu_allocator=cpu_allocator)
        self.run = run
        self.dims = run.dims if run is not None else dims or ParallelDims()
        if problems := self.unsupported_degrees(self.dims):
            raise LayoutError("\n".join(problems))
        self.plugins: dict[str, StrategyPlugin] = ordered_plugins(plugins or {}, self.ORDER)
        for plugin in self.plugins.values():
            plugin.peers(self.plugins)
        self.islands = any(plugin.islands for plugin in self.plugins.values())
        resolved = min(getattr(self.dims, axis) for axis in MESH_AXES) > 0
        self.active: tuple[StrategyPlugin, ...] = self.active_plugins(self.dims) if resolved else ()
        self.launcher_kind, self.cpu_allocator = launcher, cpu_allocator
        self.heartbeat = heartbeat_of(heartbeat_s, timeout_s)
        self._mesh_views: dict[str, DeviceMesh] = {}
        self.compute_timer = ComputeTimer()  # per-rank forward/backward seconds (balance telemetry)
        self.meshes: Meshes | None = None  # set with the mesh, in setup_environment

    @classmethod
    def from_node(cls, node: Mapping[str, Any], *, run: ResolvedRun | None = None, **settings: Any) -> MeshStrategy:
        """The strategy of a ``strategy:`` config node (`split_node`); ``settings`` override the node's."""
        dims, plugins, values = split_node(cls, node)
        return cls(dims, plugins, run=run, **{**values, **settings})

    @classmethod
    def unsupported_degrees(cls, dims: ParallelDims) -> list[str]:
        """Problems (naming the fix) of degrees on axes this strategy does not parallelize; [] if none."""
        return [
            f"strategy.{axis}={getattr(dims, axis)}: {cls.__name__} does not apply {axis} parallelism yet; "
            f"use strategy.{axis}=1"
            for axis in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
            if axis not in cls.supported_axes and getattr(dims, axis) != 1
        ]

    def active_plugins(self, dims: ParallelDims) -> tuple[StrategyPlugin, ...]:
        """The plugins a layout of resolved ``dims`` applies, in ``ORDER``."""
        return tuple(plugin for plugin in self.plugins.values() if plugin.active(dims, islands=self.islands))

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Every problem of ``run`` (and the model's ``shape``) for this strategy's plugins, in
        their order, active or not; [] when it runs. Called by `trainer.config.validate`."""
        problems = [problem for plugin in self.plugins.values() for problem in plugin.problems(run, shape)]
        return problems + [
            f"strategy.{key} does not compose with strategy.{other} yet; use strategy.{other}=null"
            for key, plugin in self.plugins.items()
            for other in plugin.conflicts
            if other in self.plugins
        ]

    def notes(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """The plugins' launch warnings (`StrategyPlugin.notes`), in their order."""
        return [note for plugin in self.plugins.values() for note in plugin.notes(run, shape)]

    # ------------------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            return
        self._launcher = launcher_for(self, self.launcher_kind)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()  # ModelParallelStrategy's helper: process group + ranks (Lightning minor pinned)
        self.dims = self.dims.resolve(self.world_size)
        self.active = self.active_plugins(self.dims)
        if self.root_device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 tensor cores for the fp32 matmuls left
        elif self.cpu_allocator == "keep_freed":
            keep_freed_host_memory()  # no page faults per step for the step's large tensors
        self._device_mesh, self._mesh_views = self.dims.build_mesh(self.root_device.type)
        self.meshes = Meshes(
            root=self._device_mesh,
            views=self._mesh_views,
            fsdp=self.dp_mesh(),
            device=self.root_device,
            plugins=self.plugins,
        )
        self.lightning_module._device_mesh = self._device_mesh
        if self.heartbeat is not None:
            self.heartbeat.start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.heartbeat is not None:  # the step a stall report names
            self.heartbeat.set_step(self.lightning_module.global_step + 1)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # The model is on its device and holds model.init_from's weights; a resume loads after this.
        for plugin in self.active:
            if plugin.when == "setup":
                plugin.apply(self.lightning_module.model, self.meshes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every pp, cp and tp rank of one data-parallel replica must see the same rows.
        dp_mesh = self.submesh("dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    def train_sampler_kwargs(self) -> dict[str, int]:
        """`distributed_sampler_kwargs` of the training rows: with replica groups (a plugin's
        `data_share`), each world trains its own share of every global batch; evaluation rows
        stay split over this world only (each group evaluates all of them)."""
        index, count = next((p.data_share() for p in self.active if p.data_share() != (0, 1)), (0, 1))
        kwargs = self.distributed_sampler_kwargs
        return {"num_replicas": kwargs["num_replicas"] * count, "rank": index * kwargs["num_replicas"] + kwargs["rank"]}

    def join_worlds(self, trainer: Any) -> None:
        """Every active plugin's `StrategyPlugin.join` (replica groups: a restarted group takes the
        others' state and step here), at the start of training before anything reads the model."""
        for plugin in self.active:
            plugin.join(trainer)

    def run_length(self, total_steps: int) -> None:
        """Every plugin's `StrategyPlugin.run_length`: the run's planned optimizer steps."""
        for plugin in self.active:
            plugin.run_length(total_steps)

    def end_training(self, model: nn.Module) -> None:
        """Every active plugin's `StrategyPlugin.end_training` (after the last step, before its callbacks and evaluation)."""
        for plugin in self.active:
            plugin.end_training(model)

    def reduce_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """The step's supervised tokens summed over other worlds too (the first active plugin's
        `StrategyPlugin.reduce_tokens`: replica groups); else ``num_tokens``."""
        for plugin in self.active:
            if (reduced := plugin.reduce_tokens(num_tokens)) is not None:
                return reduced
        return num_tokens

    def reduce_gradients(
        self, parameters: Sequence[nn.Parameter], loss: torch.Tensor, sums: Sequence[torch.Tensor] = ()
    ) -> tuple[torch.Tensor, bool]:
        """Gradients, loss and the step's named ``sums`` summed over other worlds too (the first active
        plugin's `StrategyPlugin.reduce_gradients`: replica groups) and whether the update applies; else
        ``loss`` and True."""
        for plugin in self.active:
            reduced = (
                plugin.reduce_gradients(parameters, loss, sums)
                if _takes_three(type(plugin))
                else (plugin.reduce_gradients(parameters, loss))
            )
            if reduced is not None:
                return reduced
        return loss, True

    def submesh(self, axis: str) -> DeviceMesh:
        """One mesh axis ("pp", "tp", ...) or flattened view ("dp", "dp_cp")."""
        return self._mesh_views[axis] if axis in self._mesh_views else self.device_mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of one mesh axis or flattened view ("dp", "dp_cp", "pp", ...)."""
        return self.submesh(axis).get_group()

    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard; with cp > 1
        dp_shard x cp (flattened), whose ranks hold the same parameters and sum their gradients.
        Under islands (local SGD) without dp_replicate: the islands do not reduce gradients together."""
        replicas = self.dims.dp_replicate > 1 and not self.islands
        if self.dims.cp > 1:
            return self.device_mesh["dp_replicate", "dp_shard_cp"] if replicas else self.submesh("dp_shard_cp")
        return self.device_mesh["dp_replicate", "dp_shard"] if replicas else self.device_mesh["dp_shard"]

    # ------------------------------------------------------------------------------ model
    def parallelize(self, model: nn.Module) -> None:
        """Applies the active plugins of ``when = "parallelize"`` to ``model`` in place, in ``ORDER``
        (a ``splits_stages`` plugin's stage roots are what a ``per_stage`` one is applied to); the
        ``when = "setup"`` ones follow in `setup`."""
        stage_roots = [model]
        for plugin in self.active:
            if plugin.when != "parallelize":
                continue
            if plugin.needs_real_weights:
                self.materialize(model)
            for root in stage_roots if plugin.per_stage else [model]:
                applied = plugin.apply(root, self.meshes)
            if plugin.splits_stages:
                stage_roots = applied
        self.materialize(model)

    def materialize(self, model: nn.Module) -> None:
        """`strategies.meta_init.materialize` on this rank's device (nothing for a real model)."""
        materialize(model, self.root_device)

    # ------------------------------------------------------------------------------ step
    @contextmanager
    def _stack(self, contexts: Iterator[AbstractContextManager[Any]]) -> Iterator[None]:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            yield

    def shard_batch(self, batch: Batch) -> Batch:
        """This rank's part of an evaluation batch of its dp rows (each plugin's `shard`: with cp its
        slice of the sequence; preference pairs whole)."""
        for plugin in self.active:
            batch = plugin.shard(batch, self.meshes)
        return batch

    def micro_batches(self, batch: Batch, micro_batch_size: int) -> list[Batch]:
        """This rank's micro-batches of its dp rows: the first plugin's `place` (cp: its shards, or
        hybrid placement), else runs of ``micro_batch_size`` rows."""
        for plugin in self.active:
            if (placed := plugin.place(batch, micro_batch_size, self.meshes)) is not None:
                return placed
        return micro_batches_of(batch, micro_batch_size)

    def whole_rows(self) -> AbstractContextManager[None]:
        """Forwards inside attend over whole rows on this rank (every plugin's `whole_rows`)."""
        return self._stack(plugin.whole_rows() for plugin in self.active)

    def loss_context(self) -> AbstractContextManager[None]:
        """Context for the loss and its backward (every plugin's `loss_context`: loss parallel)."""
        return self._stack(plugin.loss_context() for plugin in self.active)

    @contextmanager
    def _micro_batch(self, micro_batch: Batch) -> Iterator[Batch]:
        with ExitStack() as stack:
            for plugin in self.active:
                micro_batch = stack.enter_context(plugin.micro_batch_context(micro_batch))
            yield micro_batch

    def eval_loss_sum(self, model: nn.Module, batch: Batch, loss_sum: LossFn) -> torch.Tensor:
        """Summed token loss of one (sharded) evaluation batch on this rank, without gradients: a
        plugin's `eval_loss_sum` (pipeline: every pp rank returns the batch's loss), else the plain
        forward. Preference pairs (``[B, 2, T]``) attend whole (`whole_rows`)."""
        with self.loss_context():
            for plugin in self.active:
                if (total := plugin.eval_loss_sum(batch, loss_sum)) is not None:
                    return total
            with self.whole_rows() if batch["input_ids"].dim() == 3 else nullcontext():
                return loss_sum(model, batch)

    def forward_backward(
        self,
        model: nn.Module,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step, inside every plugin's
        `step_context` (SAT's channels, Mixout's mixed weights).

        Args:
            micro_batches: this rank's micro-batches, each a dict of [b, s] tensors.
            loss_fn: the micro-batch loss, already divided by the step's global supervised-token count.
            backward: the Task's ``manual_backward`` (unused when a plugin's `run_micro_batches` runs them).

        Returns:
            0-dim tensor: the sum of this rank's micro-batch losses (detached).
        """
        with self._stack(plugin.step_context(self.lightning_module.global_step) for plugin in self.active):
            with self.loss_context():
                for plugin in self.active:
                    if (total := plugin.run_micro_batches(micro_batches, loss_fn)) is not None:
                        return total
            return self._forward_backward(model, micro_batches, loss_fn, backward)

    def _forward_backward(
        self,
        model: nn.Module,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        total = torch.zeros((), device=self.root_device)
        last = len(micro_batches) - 1
        self.compute_timer.start_step()
        for i, micro_batch in enumerate(micro_batches):
            if isinstance(model, FSDPModule):
                # Reduce gradients once per step, after the last micro-batch, not once per micro-batch.
                model.set_requires_gradient_sync(i == last)
            with self.loss_context(), self._micro_batch(micro_batch) as rows:
                with self.compute_timer.measure(self.root_device):  # up to the gradient sync
                    loss = loss_fn(model, rows)
                    if i < last:
                        backward(loss)
                if i == last:
                    backward(loss)
            total += loss.detach()
        return total

    def grad_norm(self, parameters: Sequence[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all shards, replicas and stages; equal on every rank."""
        stage_groups = [self.group("pp")] if self.dims.pp > 1 else []
        return global_grad_norm(parameters, norm_type=norm_type, stage_groups=stage_groups)

    def clip_grads(self, parameters: Sequence[nn.Parameter], *, max_norm: float, total_norm: torch.Tensor) -> None:
        clip_grads_(parameters, max_norm=max_norm, total_norm=total_norm)

    @property
    def token_axis(self) -> str:
        """The mesh view whose ranks share one gradient and so count a step's supervised tokens
        together: dp_cp, or one island's dp_shard (x cp) under islands (each island's gradient is
        the mean over its own tokens; the plugin averages the replicas)."""
        if not self.islands:
            return "dp_cp"
        return "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"

    def all_reduce_sum(self, tensor: torch.Tensor, axis: str = "dp_cp") -> torch.Tensor:
        """In-place SUM over one mesh axis (a no-op on a single rank); returns ``tensor``."""
        if self.submesh(axis).size() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group(axis))
        return tensor

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """Every plugin's `observe_loss` with the step's training loss (step: optimizer steps done);
        the Task calls it right before `after_optimizer_step` (DASO's plateau rule reads it)."""
        for plugin in self.active:
            plugin.observe_loss(step, loss)

    def after_optimizer_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every plugin's `after_step` (step: optimizer steps done, 1 after the first; the Task's
        optimizer, unwrapped from Lightning's): e.g. ``comm/bytes_sent`` under local SGD,
        ``ep/max_over_mean_rows``, ``lora/trainable_bytes`` after step 1, ``perf/cp_whole_rows``.
        The signature is `trainer.protocols.Strategy`'s: a user's subclass overrides it as declared there."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        metrics: dict[str, Any] = {}
        for plugin in sorted(self.active, key=lambda p: p.after_others):  # stable: ORDER, then the readers
            metrics.update(plugin.after_step(model, step, optimizer))
        return metrics

    # ------------------------------------------------------------------------------ checkpoints
    # DCP writes each rank's shards once: the state hooks return nothing, and the checkpoint hooks hand
    # the live model and optimizers to `strategies.checkpoint.dcp` (or to a plugin's `checkpoint_io`).
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # gathered by DCP in save_checkpoint, once

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # gathered by DCP in save_checkpoint, once

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Writes the checkpoint through DCP (or the plugin that owns checkpoints); ``storage_options``:
        None, or an `AsyncWriter` that writes it in the background (`strategies.checkpoint.async_save`)."""
        if storage_options is not None and not isinstance(storage_options, AsyncWriter):
            raise TypeError("MeshStrategy.save_checkpoint takes storage_options=None or an AsyncWriter")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        io, keys = checkpoint_owner(self.active)
        state = {"model": self.lightning_module.model, "optimizers": self._unwrapped_optimizers(), "meta": checkpoint}
        if io is not None:
            return io.save_checkpoint(path, **state, writer=storage_options)
        ckpt.save(path, **state, keys=keys, writer=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        io, keys = checkpoint_owner(self.active)
        state = {"model": self.lightning_module.model, "optimizers": self._unwrapped_optimizers()}
        loaded = io.load_checkpoint(path, **state) if io is not None else ckpt.load(path, **state, keys=keys)
        for plugin in self.active:
            plugin.after_load(state["model"])
        return loaded

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def _unwrapped_optimizers(self) -> list[torch.optim.Optimizer]:
        return [getattr(opt, "_optimizer", opt) for opt in self.optimizers]

    @override
    def teardown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # a tombstone: this rank ended on purpose
        for plugin in self.active:
            plugin.teardown()
        super().teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


@functools.cache
def _takes_three(cls: type) -> bool:
    """Whether ``cls.reduce_gradients`` takes (parameters, loss, sums): a plugin written for the
    two-argument form (before the step's named sums travelled with it) is called with two."""
    try:
        inspect.signature(cls.reduce_gradients).bind(None, None, None, None)  # self, parameters, loss, sums
    except TypeError:
        return False
    return True


def checkpoint_owner(active: Sequence[StrategyPlugin]) -> tuple[Any, Callable[[str], bool] | None]:
    """``(io, keys)`` of the active plugins: the plugin that owns checkpoint I/O (`StrategyPlugin.checkpoint_io`;
    None: `strategies.checkpoint.dcp`), and the filter of the keys saved (every plugin's `saved_keys` at once)."""
    owners = [io for plugin in active if (io := plugin.checkpoint_io()) is not None]
    filters = [keep for plugin in active if (keep := plugin.saved_keys()) is not None]
    keys = None if not filters else filters[0] if len(filters) == 1 else lambda key: all(keep(key) for keep in filters)
    return (owners[0] if owners else None), keys


def build_strategy(node: Mapping[str, Any], *, run: ResolvedRun | None = None, **settings: Any) -> MeshStrategy:
    """The strategy a ``strategy:`` node selects: its ``_target_`` (`MeshStrategy` or a subclass) built
    by `MeshStrategy.from_node`; ``settings`` override the node's (e.g. ``launcher``)."""
    return get_class(str(node["_target_"])).from_node(node, run=run, **settings)
