"""FSDP2 (``fully_shard``) per transformer block and at the root; HSDP through dp_replicate.

Source: Zhao et al. 2023, "PyTorch FSDP"; the per-parameter-sharding FSDP2 API of
``torch.distributed.fsdp.fully_shard``. With ``dp_shard=1`` and ``dp_replicate=N`` this is plain
data parallelism (DDP semantics: parameters replicated, gradients all-reduced), on the same code
path and checkpoint format as every other layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from strategies.core.parallel_dims import Meshes, ParallelDims
from strategies.plugin import StrategyPlugin
from strategies.transforms.lora import quantize_later

if TYPE_CHECKING:
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> None:
    """Shards every block in ``model.layers`` and then the root, in place.

    Gradients are *summed* over ``dp_mesh`` rather than averaged: the Task divides each
    micro-batch's summed token loss by the global supervised-token count (`trainer.task.Task`, step 2), so an
    average would divide by the dp degree a second time (case C02). Sum reduction also avoids
    ``ReduceOp.PREMUL_SUM``, which gloo lacks.

    Args:
        model: a module with an ``nn.ModuleDict``/``ModuleList`` named ``layers``.
        dp_mesh: 1-D (dp_shard) or 2-D (dp_replicate, dp_shard: HSDP) mesh.
        param_dtype: compute dtype of the gathered parameters (None: keep fp32).
        reduce_dtype: dtype of the gradient reduction (None: param_dtype).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pin_memory needs a CUDA device; without one the policy must not pin.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    ignored = (
        set(quantize_later(model)) or None
    )  # QLoRA: sharded once quantised (`strategies.transforms.lora.quantize_pending`)
    for i, block in enumerate(layers):
        # The last block is gathered again at once by the backward pass: keeping it saves one all-gather.
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward and i < len(layers) - 1,
            ignored_params=ignored,
        )
    fully_shard(
        model,
        mesh=dp_mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        reshard_after_forward=False,
        ignored_params=ignored,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@dataclass
class FSDP(StrategyPlugin):
    """The FSDP2 plugin: settings of `apply_fsdp` as a Hydra-configurable object.

    Args:
        param_dtype: "bf16", "fp16", "fp32" or None (no mixed precision).
        reduce_dtype: dtype of gradient reduction, same choices.
        reshard_after_forward: ZeRO-3 (True) or ZeRO-2 (False) behaviour of the blocks.
        cpu_offload: CPUOffloadPolicy for parameters, gradients and optimizer state.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"strategy.fsdp.{name}={getattr(self, name)!r} is unknown; use one of "
                    f"{', '.join(str(k) for k in _DTYPES)}"
                )

    per_stage = True  # each pipeline stage is its own FSDP root

    def active(self, dims: ParallelDims, *, islands: bool) -> bool:
        """When more than one rank holds each parameter: dp_shard x cp (cp ranks hold the same
        parameters), times dp_replicate unless local-SGD islands own that axis."""
        return dims.dp_shard * dims.cp * (1 if islands else dims.dp_replicate) > 1

    def _layout(self, run: ResolvedRun) -> str | None:
        """Why FSDP shards nothing at ``run``'s layout (`active`: one rank holds each parameter); None when it shards."""
        if self.active(run.dims, islands=run.islands):
            return None
        d = run.dims
        replicas = "" if run.islands else f" x dp_replicate={d.dp_replicate}"
        return f"dp_shard={d.dp_shard} x cp={d.cp}{replicas} = 1 rank per parameter"

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """CPU offload asked for where FSDP shards nothing, which would offload nothing in silence
        (the dtypes are checked on construction; a ``param_dtype`` there is a launch warning, `notes`)."""
        if not self.cpu_offload or (layout := self._layout(run)) is None:
            return []
        return [
            f"strategy.fsdp.cpu_offload=true offloads FSDP's shards, but no FSDP shards at this layout ({layout}); "
            "shard over more ranks (strategy=fsdp trainer.devices=N), or strategy.fsdp.cpu_offload=false"
        ]

    def notes(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """A ``param_dtype`` where FSDP shards nothing and the precision does not give that compute dtype
        (one process with strategy.fsdp.param_dtype=bf16 trained in fp32 to the same digits; trainer=gpu's
        bf16 with bf16-mixed on one GPU is the autocast's, and its bf16 under trainer.precision=32-true
        is what that user asked for: warned, not refused)."""
        given = {"bf16": "bf16", "fp16": "16"}.get(self.param_dtype or "")
        if given is None or str(run.precision).startswith(given) or (layout := self._layout(run)) is None:
            return []
        fix = "set trainer.precision=bf16-mixed, or " if self.param_dtype == "bf16" else ""
        return [
            f"strategy.fsdp.param_dtype={self.param_dtype} casts the parameters FSDP gathers, but no FSDP shards at "
            f"this layout ({layout}): the run computes in trainer.precision={run.precision}; for {self.param_dtype} "
            f"compute {fix}shard over more ranks (strategy=fsdp trainer.devices=N)"
        ]

    def shard_module(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        *,
        cast: bool = True,
        ignored_params: set[nn.Parameter] | None = None,
    ) -> None:
        """``fully_shard`` of one submodule with this plugin's policies and gradient sums (expert
        parallelism shards the experts over their own ranks this way, before the blocks).
        ``cast=False`` gathers the parameters in their own dtype (QLoRA's packed 4-bit codes, which a
        cast would corrupt); ``ignored_params`` stay as they are (sharded by another unit)."""
        dtypes = (_DTYPES[self.param_dtype], _DTYPES[self.reduce_dtype]) if cast else (None, None)
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if self.cpu_offload
            else OffloadPolicy(),
            reshard_after_forward=self.reshard_after_forward,
            ignored_params=ignored_params or None,
        )
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)

    def apply(self, model: nn.Module, meshes: Meshes) -> None:
        """Shards ``model`` (the whole model, or one pipeline stage) over ``meshes.fsdp``; a QLoRA
        model's 4-bit layers are sharded as their own units once quantised (``model.lora_shard``)."""
        if quantize_later(model):
            model.lora_shard = lambda layer, ignored: self.shard_module(
                layer, meshes.fsdp, cast=False, ignored_params=ignored
            )
        apply_fsdp(
            model,
            dp_mesh=meshes.fsdp,
            param_dtype=_DTYPES[self.param_dtype],
            reduce_dtype=_DTYPES[self.reduce_dtype],
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
        )
