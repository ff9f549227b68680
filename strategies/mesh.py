"""`MeshStrategy`: the one Lightning strategy for every layout, on one named N-D device mesh.

Lightning's `ModelParallelStrategy` stops at a 2-D (data, tensor) mesh and leaves parallelism to the
user's ``configure_model``. `MeshStrategy` builds the full (pp, dp_replicate, dp_shard, cp, tp) mesh,
applies the technique plugins in a fixed order, and owns the parts of the optimizer step that a
parallelism may replace (`forward_backward`, `grad_norm`, `after_optimizer_step`) and the
checkpoint format (DCP, resharded on load).

Subclass it, override one method, and select the subclass with ``strategy._target_=my_pkg.MyStrategy``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, get_args

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from strategies.ranges import NON_NEGATIVE, POSITIVE
from strategies.activation_checkpoint import ActivationCheckpoint
from strategies.activation_offload import ActivationOffload
from strategies.compile import Compile
from strategies.compute_timer import ComputeTimer
from strategies.context import ContextParallel, CPMode
from strategies.cp_placement import placement_problems
from strategies.expert import ExpertParallel
from strategies.fsdp import FSDP
from strategies.host_allocator import CPUAllocator, keep_freed_host_memory
from strategies.launch import launcher_for
from strategies.local_sgd import LocalSGD
from strategies.mesh_checkpoint import MeshCheckpoints
from strategies.mesh_step import MeshStep
from strategies.meta_init import materialize
from strategies.lora import LoRA
from strategies.mixout import Mixout
from strategies.parallel_dims import LayoutError, Meshes, ParallelDims
from strategies.pipeline import PipelineParallel
from strategies.pipeline_layout import PPSchedule
from strategies.plugin import Plugin
from strategies.resolved import ResolvedRun
from strategies.sat import SAT
from strategies.shape import ModelShape
from strategies.tensor import TensorParallel
from strategies.watchdog import Heartbeat


class MeshStrategy(MeshStep, MeshCheckpoints, ModelParallelStrategy):
    """Builds the device mesh, parallelizes the model and runs the parallel parts of a step.

    Args:
        dp_replicate, dp_shard, cp, tp, pp: degrees (see `ParallelDims`); -1 fills the world.
        fsdp: the FSDP2 plugin; used when dp_shard or dp_replicate > 1.
        tensor_parallel: the tensor-parallel plugin (sequence and loss parallel); used when tp > 1.
        activation_offload: the activation-offload plugin (default: off;
            ``strategy.context_parallel.activation_offload=true`` also switches it on).
        activation_checkpoint: the activation-checkpointing plugin (default: off).
        compile: the per-block ``torch.compile`` plugin (default: off).
        cp_mode: context-parallel attention when cp > 1: "ring", "ulysses" or "hybrid" (Ulysses
            head groups inside, a ring across them).
        context_parallel: the context-parallel plugin (sharding, hybrid degree, activation offload).
        pp_schedule: the pipeline schedule when pp > 1: GPipe, 1F1B, Interleaved1F1B,
            InterleavedZeroBubble, ZBV or DualPipeV.
        pipeline: the pipeline plugin (stage split, stages per rank, micro-batches per schedule step).
        expert_parallel: the expert-parallel plugin (mixture-of-experts models: experts sharded
            over ep ranks borrowed from dp_shard x cp, LLEP); off when its ep is 1.
        lora: the LoRA plugin (default: off): adapters on a frozen base; checkpoints then hold
            only the adapters and their optimizer state.
        local_sgd: a local-SGD plugin (DiLoCo, DES-LOC, ...; default: off). Its islands are the
            dp_replicate axis: FSDP then shards and reduces over dp_shard (x cp) only, and the
            islands synchronise through the plugin after the optimizer steps it chooses.
        mixout: the Mixout fine-tuning regulariser (default: off): weights mixed with their
            pretrained values around each step's forward and backward.
        sat: sparsity-accelerated training (default: off): a fraction of every MLP's hidden
            channels omitted in each step's forward and backward.
        timeout_s: process-group timeout in seconds: a collective that waits longer fails.
        heartbeat_s: a rank silent for this many seconds is named by the others while they wait
            (`strategies.watchdog.Heartbeat`; 0 disables); below ``timeout_s``. A rank silent
            for ``timeout_s`` ends the run (exit 4), whatever the backend does.
        launcher: "subprocess" (the CLI: one child per rank per Hydra job) or "fork" (tests).
        cpu_allocator: on CPU, "keep_freed" makes glibc keep freed large blocks for reuse
            (`strategies.host_allocator`: no page faults per step for the step's large tensors;
            each process keeps its peak heap); "system" leaves glibc's defaults.
        run: the resolved run (`trainer.config.validate`), passed by the builder; its degrees are
            then the strategy's. None (a strategy built by hand): the degrees above, resolved
            for the world size when the processes start.

    Raises:
        LayoutError: a degree > 1 on an axis whose technique this class does not apply.
        ValueError: an unknown ``launcher`` or ``cpu_allocator``, or ``heartbeat_s >= timeout_s``.
    """

    # Mesh axes whose parallelism `parallelize` applies. A degree > 1 on any other axis would
    # build the mesh but run the whole model on each of its ranks: duplicated work and, for cp,
    # wrong gradients (each row's tokens counted cp times). A subclass that applies an axis
    # (or the plugin that implements it) adds it here.
    supported_axes: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp", "pp")

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        *,
        fsdp: FSDP | None = None,
        tensor_parallel: TensorParallel | None = None,
        activation_offload: ActivationOffload | None = None,
        activation_checkpoint: ActivationCheckpoint | None = None,
        compile: Compile | None = None,  # noqa: A002 - the config key users type
        local_sgd: LocalSGD | None = None,
        cp_mode: CPMode = "ring",
        context_parallel: ContextParallel | None = None,
        pp_schedule: PPSchedule = "1F1B",
        pipeline: PipelineParallel | None = None,
        expert_parallel: ExpertParallel | None = None,
        lora: LoRA | None = None,
        mixout: Mixout | None = None,
        sat: SAT | None = None,
        timeout_s: Annotated[float, POSITIVE] = 600.0,
        heartbeat_s: Annotated[float, NON_NEGATIVE] = 60.0,
        launcher: str = "subprocess",
        cpu_allocator: CPUAllocator = "keep_freed",
        run: ResolvedRun | None = None,
    ) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s))
        if launcher not in ("subprocess", "fork"):
            raise ValueError(f"strategy.launcher={launcher!r} is unknown; use subprocess or fork")
        if cpu_allocator not in get_args(CPUAllocator):
            raise ValueError(f"strategy.cpu_allocator={cpu_allocator!r} is unknown; use {' or '.join(get_args(CPUAllocator))}")
        if heartbeat_s >= timeout_s:
            raise ValueError(
                f"strategy.heartbeat_s={heartbeat_s:g} must be below strategy.timeout_s={timeout_s:g} (a stalled rank is "
                "named before its collective times out); lower heartbeat_s (0 disables it)"
            )
        self.run = run
        self.dims = run.dims if run is not None else ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
        problems = self.unsupported_degrees(self.dims)
        if problems:
            raise LayoutError("\n".join(problems))
        self.fsdp = fsdp or FSDP()
        self.tensor_parallel = tensor_parallel or TensorParallel()
        self.activation_checkpoint = activation_checkpoint or ActivationCheckpoint()
        self.compile_plugin = compile or Compile()
        self.cp_mode = cp_mode
        self.context_parallel = context_parallel or ContextParallel()
        self.activation_offload = activation_offload or ActivationOffload()
        if self.context_parallel.activation_offload:  # the older spelling of the same switch
            self.activation_offload = ActivationOffload(enabled=True)
        self.pp_schedule = pp_schedule
        self.pipeline = pipeline or PipelineParallel()
        self.local_sgd = local_sgd
        self.expert_parallel = expert_parallel or ExpertParallel()
        self.expert_parallel.fsdp = self.fsdp  # the experts' own FSDP takes the blocks' policies
        self.lora = lora
        self.mixout, self.sat = mixout, sat
        self.launcher_kind = launcher
        self.cpu_allocator = cpu_allocator
        self.heartbeat = (
            Heartbeat(stale_s=heartbeat_s, interval_s=min(5.0, heartbeat_s / 4), abort_s=timeout_s) if heartbeat_s else None
        )
        self._mesh_views: dict[str, DeviceMesh] = {}
        self.compute_timer = ComputeTimer()  # per-rank forward/backward seconds (balance telemetry)
        self.meshes: Meshes | None = None  # set with the mesh, in setup_environment

    @classmethod
    def unsupported_degrees(cls, dims: ParallelDims) -> list[str]:
        """Problems (naming the fix) of degrees on axes this strategy does not parallelize; [] if none."""
        return [
            f"strategy.{axis}={getattr(dims, axis)}: {cls.__name__} does not apply {axis} parallelism yet; "
            f"use strategy.{axis}=1"
            for axis in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
            if axis not in cls.supported_axes and getattr(dims, axis) != 1
        ]

    def plugins(self, dims: ParallelDims) -> list[Plugin]:
        """The plugins a layout of resolved ``dims`` applies, in the order `parallelize` applies them."""
        fsdp_ranks = dims.dp_shard * dims.cp * (dims.dp_replicate if self.local_sgd is None else 1)
        chosen = [
            (self.pipeline, dims.pp > 1),
            (self.tensor_parallel, dims.tp > 1),
            (self.context_parallel, dims.cp > 1),
            (self.expert_parallel, True),  # off (apply does nothing) when its ep is 1
            (self.lora, self.lora is not None),
            (self.activation_offload, True),
            (self.activation_checkpoint, True),
            (self.compile_plugin, True),
            (self.fsdp, fsdp_ranks > 1),  # cp ranks hold the same parameters: FSDP shards them too
            (self.sat, self.sat is not None),
            (self.mixout, self.mixout is not None),
            (self.local_sgd, self.local_sgd is not None),
        ]
        return [plugin for plugin, used in chosen if used]

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Every problem of ``run`` (and the model's ``shape``) for this strategy's plugins, in
        their order; [] when it runs. Called by `trainer.config.validate`, before any process starts."""
        problems = [problem for plugin in self.plugins(run.dims) for problem in plugin.problems(run, shape)]
        if self.lora is not None and self.local_sgd is not None:
            problems.append("strategy.lora does not compose with strategy.local_sgd yet; use strategy.local_sgd=null")
        if run.dims.cp <= 1:  # the cp plugin (which checks its placement) is not applied
            placement = self.context_parallel.placement
            problems += placement_problems(placement, cp=1, pp=run.dims.pp, micro_batch_size=run.micro_batch_size)
        return problems

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
        if self.local_sgd is not None and self.dims.dp_replicate < 2:
            raise LayoutError(
                f"strategy.local_sgd needs at least 2 islands but strategy.dp_replicate={self.dims.dp_replicate}; "
                f"use more ranks or a smaller strategy.dp_shard, or set strategy.local_sgd=null"
            )
        if self.root_device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 tensor cores for the fp32 matmuls left
        elif self.cpu_allocator == "keep_freed":
            keep_freed_host_memory()  # no page faults per step for the step's large tensors
        self._device_mesh, self._mesh_views = self.dims.build_mesh(self.root_device.type)
        self.meshes = Meshes(
            root=self._device_mesh, views=self._mesh_views, fsdp=self.dp_mesh(), device=self.root_device,
            pp_schedule=self.pp_schedule, cp_mode=self.cp_mode,
        )  # fmt: skip
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
        if self.local_sgd is not None:
            # After configure_model has loaded model.init_from and the model is on its device: the
            # plugin's global parameters (DiLoCo's anchors) start from the weights training starts
            # from. A resumed run then loads the plugin's saved state over them.
            self.local_sgd.apply(self.lightning_module.model, self.meshes)
        if self.mixout is not None:  # its anchors: the same weights, before a resume overwrites them
            self.mixout.apply(self.lightning_module.model, self.meshes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every pp, cp and tp rank of one data-parallel replica must see the same rows.
        dp_mesh = self.submesh("dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def submesh(self, axis: str) -> "DeviceMesh":
        """One mesh axis ("pp", "tp", ...) or flattened view ("dp", "dp_cp")."""
        return self._mesh_views[axis] if axis in self._mesh_views else self.device_mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of one mesh axis or flattened view ("dp", "dp_cp", "pp", ...)."""
        return self.submesh(axis).get_group()

    # ------------------------------------------------------------------------------ model
    def parallelize(self, model: nn.Module) -> None:
        """Applies the plugins of `plugins` to ``model`` in place, in their fixed order.

        Order (later techniques wrap what earlier ones produced): pipeline split first (each rank
        keeps its stages; the others then work on fewer layers), then tensor parallel
        (DTensor-shards the Linear weights), then context-parallel attention (its attention core
        sees the tp rank's heads of its cp shard), then expert parallelism (an MoE block sees its
        rank's tokens; the experts get their own FSDP over the ranks left of dp_shard x cp, which
        the blocks' FSDP then leaves alone), then LoRA (its adapters take the placements of the
        tensor-parallel base weights, and its hooks run inside every later wrapper), then activation offload (hooks around each
        block, kept by the checkpointed forward). Activation checkpointing next, so the recomputed
        forward is the TP/CP one. Compile after it, so each compiled block graph contains the
        checkpoint (and the recomputation is compiled too). FSDP then shards whatever parameters
        the others left, on the dp axes only, each pipeline stage as its own root; its per-block
        hooks stay outside the checkpointed function (the recomputation uses the parameters FSDP
        gathered for the backward instead of running the hooks again) and dynamo runs them eagerly
        around the compiled graph. SAT then finds the MLPs it works on inside each step
        (`forward_backward`). Mixout and local SGD last, in `setup`: they keep the parameter
        objects the optimizer will hold, and their anchors (Mixout's pretrained weights, DiLoCo's
        global parameters) must be the weights training starts from, loaded after this
        (``model.init_from``) and before a resumed run's checkpoint.
        """
        stage_modules = [model]
        for plugin in self.plugins(self.dims):
            if plugin is self.local_sgd or plugin is self.mixout:
                continue  # applied in `setup`, on the materialised weights model.init_from loaded
            if plugin is self.lora:
                # LoRA creates its adapters beside real base weights.
                self.materialize(model)
            if plugin is self.fsdp:
                for module in stage_modules:
                    plugin.apply(module, self.meshes)
                continue
            applied = plugin.apply(model, self.meshes)
            if plugin is self.pipeline:
                stage_modules = applied
        self.materialize(model)

    def materialize(self, model: nn.Module) -> None:
        """`strategies.meta_init.materialize` on this rank's device (nothing for a real model)."""
        materialize(model, self.root_device)

    def dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard; with cp > 1
        dp_shard x cp (flattened), whose ranks hold the same parameters and sum their gradients.
        Under local SGD without dp_replicate: its islands do not reduce gradients with each other."""
        if self.dims.cp > 1:
            if self.dims.dp_replicate > 1 and self.local_sgd is None:
                return self.device_mesh["dp_replicate", "dp_shard_cp"]
            return self.submesh("dp_shard_cp")
        if self.dims.dp_replicate > 1 and self.local_sgd is None:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    # ------------------------------------------------------------------------------ after the step
    def after_optimizer_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Hook after each optimizer step: the local-SGD synchronisations, LoRA's one report.

        Args:
            step: optimizer steps done (1 after the first).
            optimizer: the Task's (inner) optimizer, possibly Lightning-wrapped.

        Returns:
            Metrics of the step for the loggers: ``comm/bytes_sent`` (bytes this rank sent to other
            islands in this step) and ``comm/bytes_sent_total`` under local SGD;
            ``ep/max_over_mean_rows`` under expert parallelism; with LoRA after the first step
            ``lora/trainable_bytes`` and ``lora/optimizer_state_bytes``; with cp hybrid placement
            ``perf/cp_whole_rows`` (rows of a cp group trained whole in the step) and ``perf/cp_rows_g<g>``
            (its rows on groups of g ranks; g = cp: split over the whole group).
        """
        metrics = self.expert_parallel.rank_load_metrics()
        if self.dims.cp > 1 and self.context_parallel.placement == "hybrid":
            rows = self.context_parallel.group_rows
            metrics["perf/cp_whole_rows"] = float(rows.get(1, 0))
            metrics.update({f"perf/cp_rows_g{g}": float(n) for g, n in sorted(rows.items())})
        if self.lora is not None and step == 1:
            metrics.update(
                self.lora.report(self.lightning_module.model, getattr(optimizer, "_optimizer", optimizer), verbose=self.is_global_zero)
            )
        if self.local_sgd is None:
            return metrics
        return {**metrics, **self.local_sgd.after_optimizer_step(getattr(optimizer, "_optimizer", optimizer))}

    @override
    def teardown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()  # a tombstone: this rank ended on purpose
        super().teardown()
        if dist.is_initialized():
            dist.destroy_process_group()

