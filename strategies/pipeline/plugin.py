"""Pipeline parallelism: the model split into stages over the pp axis, run by a torch schedule.

Sources: Huang et al. 2019, "GPipe"; Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (1F1B, interleaved 1F1B); Qi et al. 2024, "Zero
Bubble Pipeline Parallelism" (InterleavedZeroBubble, ZBV); DeepSeek-AI 2024, "DeepSeek-V3
Technical Report" (DualPipe, here its V form DualPipeV). The schedules are those of
``torch.distributed.pipelining``.

Every rank builds the whole model and keeps the layers of its stages: ``layers`` is a ModuleDict
keyed by the global layer index, so parameter names are the same at every pp degree and a DCP
checkpoint reshards across them. With several stages per rank (interleaved and V schedules) each
stage is a *view*: a module of the model's class that shares the rank's submodules, so the rank's
model still holds every parameter once under its usual name.

Numerics (the step of `trainer.task.Task`): the schedule's loss of a micro-batch is the Task's loss (summed token
loss / the step's global supervised-token count) and gradients are not rescaled
(``scale_grads=False``), so the gradients equal those without pipelining. ``position_ids`` and
``document_ids`` go to every stage as keyword arguments (each rank of a data-parallel replica
holds the same rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from strategies.core.model_contract import optional
from strategies.core.parallel_dims import Meshes, ParallelDims
from strategies.pipeline.layout import (
    SPLIT_BACKWARD_SCHEDULES,
    PPSchedule,
    check_pipeline,
    local_stages,
    stage_layers,
    stage_owner,
    stages_per_rank_of,
)
from strategies.pipeline.stages import (
    backward_initialized,
    build_schedule,
    model_kwargs,
    pack_targets,
    split_model,
    stage_loss,
)
from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape


# ---------------------------------------------------------------------------------- the plugin
@dataclass
class PipelineParallel(StrategyPlugin):
    """The pipeline plugin: how the model is split and how micro-batches are scheduled.

    Active when pp > 1: `apply` splits the model and returns its stage roots (``splits_stages``);
    the schedule then runs the step's micro-batches (`run_micro_batches`) and evaluation's
    forward (`eval_loss_sum`).

    Args:
        schedule: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBV or DualPipeV.
        stages_per_rank: stages (virtual stages) per rank; null: 1 for GPipe/1F1B, 2 otherwise.
        split_points: first layer of every stage but the first, e.g. [3, 6, 9] for 4 stages of
            12 layers; null: as ``split`` says.
        split: "layers" (the same number of blocks per stage) or "auto": stages balanced by the
            planner's predicted cost of each part (embedding, blocks, norm + head + loss;
            `strategies.planner.time.auto_split_points`), resolved once into the run's
            ``pp_split_points`` (`ResolvedRun`), which the builder passes here as ``split_points``.
        num_microbatches: micro-batches per schedule step; null: all of the optimizer step's
            micro-batches in one schedule step. Fewer run several schedule steps whose gradients
            accumulate (less activation memory for GPipe, a larger bubble).

    `apply` runs in ``MeshStrategy.parallelize``; the torch stages and schedules are built at the first step,
    after Lightning has moved the model to its device.
    """

    splits_stages = True

    schedule: PPSchedule = "1F1B"
    stages_per_rank: int | None = None
    split_points: list[int] | None = None
    split: str = "layers"
    num_microbatches: int | None = None
    _state: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        return dims.pp > 1

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """The layout against the model's layers and the step's micro-batches (`check_pipeline`),
        the data's last batch (a partial one cannot fill the schedule's micro-batches), and a
        mixture of experts or compiled blocks under a schedule that splits backward."""
        pp = run.dims.pp
        if pp <= 1:
            return []
        problems = []
        if shape is not None and shape.num_experts and self.schedule in SPLIT_BACKWARD_SCHEDULES:
            problems.append(
                f"strategy.pipeline.schedule={self.schedule} splits backward into input and weight passes, which a "
                "mixture of experts does not support yet; use strategy.pipeline.schedule=1F1B, GPipe or Interleaved1F1B"
            )
        if run.compile and self.schedule in SPLIT_BACKWARD_SCHEDULES:
            problems.append(
                f"strategy.pipeline.schedule={self.schedule} splits backward into input and weight passes, which "
                "compiled blocks do not support (torch's pipelining: pytorch/pytorch#161904); use "
                "strategy.pipeline.schedule=1F1B, GPipe or Interleaved1F1B, or strategy.compile.enabled=false"
            )
        if shape is not None:
            if pp > shape.n_layers:
                problems.append(
                    f"strategy.pp={pp} stages need at least as many blocks, but the model has {shape.n_layers}; use strategy.pp<={shape.n_layers}"
                )
            problems += check_pipeline(
                pp=pp,
                schedule=self.schedule,
                stages_per_rank=self.stages_per_rank,
                split_points=self.split_points,
                num_microbatches=self.num_microbatches,
                microbatches_per_step=run.num_micro_batches or None,
                n_layers=shape.n_layers,
                tie_embeddings=shape.tie_embeddings,
                split=self.split,
            )
        elif self.split == "auto" and self.split_points is None:
            problems.append(
                "strategy.pipeline.split=auto balances the planner's per-layer costs, which it models for Llama-style "
                "models only; use strategy.pipeline.split=layers or give strategy.pipeline.split_points"
            )
        if not run.drop_last:
            problems.append(
                "data.drop_last=false gives a last, partial global batch, which does not fill the pipeline's "
                "micro-batches; use data.drop_last=true with strategy.pp > 1"
            )
        return problems

    def apply(self, model: nn.Module, meshes: Meshes) -> list[nn.Module]:
        """Splits ``model`` in place for this rank (over ``meshes["pp"]``, in ``self.schedule``);
        returns its stage modules (each its own FSDP root).

        Raises:
            ValueError: the layout cannot run (see `check_pipeline`), an unknown schedule, or
                ``split="auto"`` without resolved ``split_points``.
        """
        if self.split == "auto" and self.split_points is None:
            raise ValueError(
                "strategy.pipeline.split=auto needs its split points resolved from the run (ResolvedRun.pp_split_points, "
                "passed by trainer.build.build_strategy); pass split_points=[...] when building the plugin yourself"
            )
        pp_mesh, schedule, device = meshes["pp"], self.schedule, meshes.device
        pp, v = pp_mesh.size(), stages_per_rank_of(schedule, self.stages_per_rank)
        problems = check_pipeline(
            pp=pp,
            schedule=schedule,
            stages_per_rank=self.stages_per_rank,
            split_points=self.split_points,
            num_microbatches=self.num_microbatches,
            microbatches_per_step=None,
            n_layers=len(model.layers),
            tie_embeddings=bool(optional(model, "tie_embeddings")),
        )
        if problems:
            raise ValueError("\n".join(problems))
        stages = local_stages(pp_mesh.get_local_rank(), pp=pp, stages_per_rank=v, schedule=schedule)
        layers = stage_layers(len(model.layers), pp * v, self.split_points)
        modules = split_model(model, stages=stages, layers=layers)
        head = None
        if pp * v - 1 in stages:  # the last stage returns hidden states; the loss applies its head
            last = modules[stages.index(pp * v - 1)]
            head = last.output
            last.forward = functools.partial(type(last).forward, last, return_hidden=True)
        self._state = {
            "root": model, "modules": modules, "stages": stages, "num_stages": pp * v, "schedule": schedule,
            "pp": pp, "group": pp_mesh.get_group(), "rank": pp_mesh.get_local_rank(), "device": device,
            "schedules": {}, "loss_fn": None, "head": head, "keys": ["labels"], "running": None,
        }  # fmt: skip
        return modules

    # ------------------------------------------------------------------ training
    def _schedule(self, num_microbatches: int) -> Any:
        s = self._state
        if num_microbatches not in s["schedules"]:
            self._refresh_view_buffers()
            s["schedules"][num_microbatches] = build_schedule(
                s["modules"],
                stages=s["stages"],
                num_stages=s["num_stages"],
                schedule=s["schedule"],
                num_microbatches=num_microbatches,
                loss_fn=self._loss,
                group=s["group"],
                device=s["device"],
            )
        return s["schedules"][num_microbatches]

    def _refresh_view_buffers(self) -> None:
        # The views' buffers (RoPE tables) follow the model's: Lightning moves it to its device, and
        # a model built on the meta device gets new ones when it is materialised.
        s = self._state
        for view in s["modules"]:
            view._buffers.update(s["root"].named_buffers(recurse=False))

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self._state
        if not backward_initialized(s["running"]):
            # torch's backward-metadata inference (at a schedule's first step) runs the loss once
            # more on a micro-batch; only the gradient's shapes matter there. The objective's loss
            # would also add that micro-batch to its sums (per-source losses) a second time.
            local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
            return local.float().sum() * 0.0
        return stage_loss(s["loss_fn"], hidden, s["head"], s["keys"], targets)

    def run_micro_batches(
        self,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """`forward_backward`: the schedule runs the step's micro-batches."""
        return self.forward_backward(micro_batches, loss_fn)

    def forward_backward(
        self,
        micro_batches: Sequence[dict[str, torch.Tensor]],
        loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """Runs the step's micro-batches through the schedule (forward and backward).

        Args:
            micro_batches: this rank's micro-batches (dicts of [b, s] tensors), all of b rows; the
                same on every rank of the pp group.
            loss_fn: the Task's micro-batch loss (already divided by the global token count).

        Returns:
            0-dim tensor: the sum of the step's micro-batch losses, the same on every pp rank.

        Raises:
            ValueError: the micro-batches do not fill whole schedule steps, or too few for the schedule.
        """
        s = self._state
        m = self.num_microbatches or len(micro_batches)
        if len(micro_batches) % m:
            raise ValueError(
                f"{len(micro_batches)} micro-batches do not fill schedule steps of strategy.pipeline.num_microbatches={m}"
            )
        schedule = self._schedule(m)
        s["loss_fn"], s["running"] = loss_fn, schedule
        first, last = 0 in s["stages"], s["num_stages"] - 1 in s["stages"]
        total = torch.zeros((), device=s["device"])
        for start in range(0, len(micro_batches), m):  # gradient accumulation over schedule steps
            group = micro_batches[start : start + m]
            batch = {key: torch.cat([mb[key] for mb in group]) for key in group[0]}
            losses: list[torch.Tensor] = []
            args = (batch["input_ids"],) if first else ()
            s["keys"], targets = pack_targets(batch)
            target = targets if last else None
            schedule.step(
                *args, target=target, losses=losses, return_outputs=False, **model_kwargs(s["modules"][0], batch)
            )
            if last:
                total += torch.stack([loss.detach() for loss in losses]).sum()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=s["group"])  # only the last stage had it
        return total

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_loss_sum(
        self,
        batch: dict[str, torch.Tensor],
        loss_sum: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """Summed token loss of one evaluation batch: a forward through the stages in order.

        Point-to-point over the pp group, one micro-batch (any number of rows); every pp rank
        returns the same 0-dim tensor.
        """
        s = self._state
        self._refresh_view_buffers()
        pp, schedule, group = s["pp"], s["schedule"], s["group"]
        kwargs = model_kwargs(s["modules"][0], batch)
        modules = dict(zip(s["stages"], s["modules"]))
        total = torch.zeros((), device=s["device"])
        hidden = None
        for stage in range(s["num_stages"]):
            if stage not in modules:
                continue
            previous = stage_owner(stage - 1, pp=pp, schedule=schedule) if stage else s["rank"]
            if stage == 0:
                hidden = batch["input_ids"]
            elif previous != s["rank"]:
                hidden = _recv_hidden(previous, group, s["device"])
            hidden = modules[stage](hidden, **kwargs)
            if stage == s["num_stages"] - 1:
                keys, targets = pack_targets(batch)
                total += stage_loss(loss_sum, hidden, s["head"], keys, targets).detach()
            else:
                following = stage_owner(stage + 1, pp=pp, schedule=schedule)
                if following != s["rank"]:
                    _send_hidden(hidden, following, group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send_hidden(hidden: torch.Tensor, peer: int, group: dist.ProcessGroup) -> None:
    # A header first: the dtype depends on the precision settings and the shape on the layout
    # (with sequence parallelism a stage holds [B, T/tp, D]), neither of which the receiver knows.
    header = torch.tensor([_DTYPES.index(hidden.dtype), *hidden.shape], device=hidden.device)
    dist.send(header, group_dst=peer, group=group)
    dist.send(hidden.contiguous(), group_dst=peer, group=group)


def _recv_hidden(peer: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.zeros(4, dtype=torch.long, device=device)  # dtype code, B, T, D
    dist.recv(header, group_src=peer, group=group)
    code, *shape = header.tolist()
    hidden = torch.empty(*shape, dtype=_DTYPES[code], device=device)
    dist.recv(hidden, group_src=peer, group=group)
    return hidden
