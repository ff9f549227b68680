"""float8 training: the model's Linear layers compute their matmuls in float8 through torchao.

Source: Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (e4m3 for activations and
weights, e5m2 for gradients, one dynamic scale ``finfo.max / amax`` per tensor); torchao's
``torchao.float8`` (``convert_to_float8_training``, its ``tensorwise`` and ``rowwise`` recipes, the
float8 all-gather under FSDP2 with the weights' scales precomputed in one all-reduce after each
optimizer step), applied the way torchtitan's float8 converter applies it.

Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear`` under the same name (checkpoints,
``train.no_decay`` and the seeded initialisation see the same keys): its input, weight and output
gradient are cast to float8 with dynamic scales at every matmul and the master weights stay in their
own dtype. Layers stay in high precision when their name matches a ``keep_high_precision`` pattern
(by default the LM head and the MoE routers: the logits and the routing decide the loss directly),
when a dimension is not a multiple of 16 (the float8 kernels cannot take them) or when their weight
is tied to another module (the embedding lookup cannot read a float8-cast weight). Without a CUDA
GPU of SM 8.9+ (CPU runs) torchao emulates the float8 matmul: the same casts, then the product of
the dequantized values in fp32, so CPU tests run the path a GPU runs, slower.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from strategies.plugin import StrategyPlugin

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

Recipe = Literal["tensorwise", "rowwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
# The LM head and the MoE routers (`trainer.models.moe`: layers.<i>.feed_forward.router.gate).
KEEP_HIGH_PRECISION: tuple[str, ...] = ("output", "*.router.*")
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (SM 8.9), Hopper (SM 9.0) and later


def _torchao_float8() -> Any:
    """``torchao.float8``, imported when a run converts a model (its import is slow and logs the
    CUDA kernels a CPU build lacks, which float8 training does not use, and a deprecation of torch's
    pytree that is torchao's to fix: warnings a user can do nothing about, on every rank)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # lazily: 1.5 s of import, and only a float8 run needs it
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return torchao.float8


def converts(module: nn.Module, fqn: str, keep_high_precision: Sequence[str], tied: set[int]) -> bool:
    """Whether `apply_float8` converts ``module`` (named ``fqn`` in the model): an ``nn.Linear``
    whose weight dims are multiples of 16, not tied (``tied``: ids of weights shared with another
    module) and whose name matches no ``keep_high_precision`` glob pattern."""
    if not isinstance(module, nn.Linear) or id(module.weight) in tied:
        return False
    return eligible(fqn, tuple(module.weight.shape), keep_high_precision)


def eligible(fqn: str, weight_shape: Sequence[int], keep_high_precision: Sequence[str]) -> bool:
    """Whether a Linear named ``fqn`` with a weight of ``weight_shape`` (whole) goes to float8: its
    dims are multiples of 16 and its name matches no ``keep_high_precision`` pattern (`converts`,
    and validate's check of what a GPU's kernel takes, which reads the shape off `ModelShape`)."""
    if any(n % 16 for n in weight_shape):
        return False
    return not any(fnmatchcase(fqn, pattern) for pattern in keep_high_precision)


def _tied_weights(model: nn.Module) -> set[int]:
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def apply_float8(
    model: nn.Module,
    *,
    recipe: Recipe,
    keep_high_precision: Sequence[str] = KEEP_HIGH_PRECISION,
    emulate: bool = False,
    fsdp_float8_all_gather: bool = False,
    round_scales_to_power_of_2: bool | None = None,
) -> list[str]:
    """Swaps the chosen ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear``, in place.

    Args:
        model: any module (on the meta device or materialized; before TP and FSDP).
        recipe: "tensorwise" (one scale per tensor; e4m3 forward, e5m2 gradients) or "rowwise"
            (one scale per row, powers of 2; e4m3 everywhere).
        keep_high_precision: glob patterns of module names left in high precision (`converts`).
        emulate: the float8 matmul in fp32 on the dequantized values (devices without float8 kernels).
        fsdp_float8_all_gather: FSDP2 all-gathers the weights already cast to float8 (tensorwise only;
            pair it with `precompute_float8_scales` after each optimizer step).
        round_scales_to_power_of_2: round every scale down to a power of 2 (None: the recipe's
            own choice, tensorwise no, rowwise yes). A power-of-2 scale only shifts the exponent,
            so a last-bit difference of an amax (a sum taken in another order, as tensor
            parallelism's partial sums are) rarely changes it, and the cast values stay the same.

    Returns:
        The names of the converted layers.

    Raises:
        ValueError: an unknown recipe, or the float8 all-gather with a recipe other than tensorwise
            or with power-of-2 scales (torchao's all-gather computes its own, unrounded ones).
    """
    if recipe not in RECIPES:
        raise ValueError(f"strategy.float8.recipe={recipe!r} is unknown; use one of {', '.join(RECIPES)} or null")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError("the float8 all-gather needs strategy.float8.recipe=tensorwise (one scale per weight)")
    if fsdp_float8_all_gather and round_scales_to_power_of_2:
        raise ValueError("the float8 all-gather computes its own scales, not rounded to powers of 2")
    float8 = _torchao_float8()
    config = replace(
        float8.Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )
    if round_scales_to_power_of_2 is not None:
        config = replace(config, round_scales_to_power_of_2=round_scales_to_power_of_2)
    tied = _tied_weights(model)
    chosen = [fqn for fqn, module in model.named_modules() if converts(module, fqn, keep_high_precision, tied)]
    keep = set(chosen)
    float8.convert_to_float8_training(model, module_filter_fn=lambda _module, fqn: fqn in keep, config=config)
    return chosen


def precompute_float8_scales(model: nn.Module) -> None:
    """Computes the float8 scales of every FSDP-sharded float8 weight of ``model`` in one all-reduce
    of their amaxes (instead of one per weight in the next forward's all-gathers); after each
    optimizer step, while the float8 all-gather is on."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def is_cuda(accelerator: str) -> bool:
    """Whether a run of Lightning's ``trainer.accelerator`` value runs on a CUDA GPU of this machine."""
    return accelerator in ("gpu", "cuda") or accelerator == "auto" and torch.cuda.is_available()


@dataclass
class Float8(StrategyPlugin):
    """The float8 plugin: `apply_float8` on the model before the parallelisms, and the scale
    precompute after each optimizer step under the float8 all-gather.

    Args:
        recipe: "tensorwise", "rowwise", or None (off: the model trains in its own precision).
        keep_high_precision: glob patterns of Linear names kept out of float8 (fnmatch, whole name:
            ``output`` is the LM head, ``layers.0.*`` the first block).
        fsdp_float8_all_gather: FSDP2 all-gathers float8 weights (half the bytes of bf16): None
            (auto) turns it on for tensorwise without power-of-2 scales when FSDP shards the
            weights; True needs that too, and tp = 1.
        emulate: the float8 matmul emulated in fp32; None (auto): emulated unless on a CUDA GPU.
        round_scales_to_power_of_2: every scale a power of 2 (`apply_float8`); None: the recipe's
            choice (tensorwise no, rowwise yes). Tensor parallelism with tensorwise needs it.
        accelerator: the run's ``trainer.accelerator`` (the device validate checks the recipe for).
    """

    # The scales are read from the weights as the step leaves them: after local SGD's averages and merges.
    after_others: ClassVar[bool] = True

    recipe: Recipe | None = None
    keep_high_precision: Sequence[str] = KEEP_HIGH_PRECISION
    fsdp_float8_all_gather: bool | None = None
    emulate: bool | None = None
    round_scales_to_power_of_2: bool | None = None
    accelerator: str = "auto"

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(
                f"strategy.float8.recipe={self.recipe!r} is unknown; use one of {', '.join(RECIPES)} or null (off)"
            )
        self.keep_high_precision = [str(pattern) for pattern in self.keep_high_precision]
        self._all_gather = False  # set by apply: whether the weights are all-gathered in float8

    @property
    def power_of_2_scales(self) -> bool:
        """Whether the scales are rounded to powers of 2: as set, else the recipe's choice (rowwise)."""
        if self.round_scales_to_power_of_2 is not None:
            return self.round_scales_to_power_of_2
        return self.recipe == "rowwise"

    def active(self, dims: Any, *, islands: bool) -> bool:
        return self.recipe is not None

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """What the device or the layout cannot run: float8 kernels below SM 8.9 (or none, on CPU)
        without emulation, or dims they cannot take (`_kernel_shape_problems`); the float8 all-gather with rowwise, power-of-2 scales or TP; TP without
        power-of-2 scales; tensorwise with CP; LoRA. (Compile takes the
        emulation too: a compiled emulated Linear equals the eager one bitwise on CPU.)"""
        if self.recipe is None:
            return []
        out = []
        cuda = is_cuda(self.accelerator)
        if self.emulate is False and not cuda:
            out.append(
                f"strategy.float8.emulate=false needs a CUDA GPU (trainer.accelerator={self.accelerator}); "
                "use strategy.float8.emulate=null (emulated in fp32 on CPU)"
            )
        elif cuda and not self.emulate and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
            if capability < MIN_CAPABILITY:
                out.append(
                    f"strategy.float8 needs float8 tensor cores (SM 8.9+: L4, L40, H100, ...); this GPU is SM "
                    f"{capability[0]}.{capability[1]}; use strategy.float8.recipe=null (or strategy.float8.emulate=true: "
                    "exact but slower than bf16)"
                )
        if cuda and not self.emulate:
            out += self._kernel_shape_problems(run, shape)
        tp, cp, pow2 = run.dims.tp, run.dims.cp, self.power_of_2_scales
        if self.fsdp_float8_all_gather:  # every refusal of it names the fix that always runs: null
            why = (
                f"recipe={self.recipe} has one scale per row"
                if self.recipe != "tensorwise"
                else "its scales are torchao's own, not rounded to powers of 2 as set"
                if pow2
                else f"tensor parallelism (strategy.tp={tp}) needs power-of-2 scales, which torchao's all-gather "
                "does not round to"
                if tp > 1
                else None
            )
            if why:
                out.append(
                    f"strategy.float8.fsdp_float8_all_gather=true needs one unrounded scale per weight ({why}); use "
                    "strategy.float8.fsdp_float8_all_gather=null (the weights are then gathered in high precision)"
                )
        if self.fsdp_float8_all_gather and run.dims.dp_shard * cp == 1:  # a reviewer: accepted, then silently off
            out.append(
                "strategy.float8.fsdp_float8_all_gather=true, but FSDP shards no weight in this layout (strategy.dp_shard"
                f"={run.dims.dp_shard}, strategy.cp={cp}): nothing is all-gathered; use strategy.float8.fsdp_float8_all_gather"
                "=null"
            )
        if self.recipe == "tensorwise" and cp > 1:
            out.append(
                f"strategy.float8.recipe=tensorwise with context parallelism (strategy.cp={cp}) scales each rank's part "
                "of the sequence on its own, where one process scales the whole micro-batch (losses 1e-5 apart from the "
                "first step); use strategy.float8.recipe=rowwise (one scale per token row: equal to one process)"
            )
        elif tp > 1 and not pow2 and not self.fsdp_float8_all_gather:
            fix = (
                "strategy.float8.round_scales_to_power_of_2=true or strategy.float8.recipe=rowwise"
                if self.recipe == "tensorwise"
                else "strategy.float8.round_scales_to_power_of_2=null"
            )
            out.append(
                f"strategy.float8.recipe={self.recipe} with tensor parallelism (strategy.tp={tp}) needs power-of-2 "
                "scales: a scale of finfo.max / amax moves with the last bit of an amax, which TP's partial sums change, "
                f"and the cast values with it (tensorwise: 3 SGD steps left most of wv's and wo's weights up to 6% off "
                f"one process); use {fix}"
            )
        for pattern in self.keep_high_precision if shape is not None else ():
            if pattern not in KEEP_HIGH_PRECISION and not any(
                fnmatchcase(fqn, pattern) for fqn in shape.linear_modules
            ):
                kinds = sorted({re.sub(r"\.\d+\.", ".*.", fqn) for fqn in shape.linear_modules})
                out.append(
                    f"strategy.float8.keep_high_precision: {pattern!r} matches no Linear layer of this model (the "
                    f"patterns are globs over whole names, such as {', '.join(repr(k) for k in kinds[:3])}; '*.' "
                    f"before a short name: '*.{pattern}'), so what it names would train in float8"
                )
        if shape is not None and not self._converted(shape):
            out.append(
                f"strategy.float8.recipe={self.recipe} converts no Linear layer of this model (a float8 layer's weight "
                "dims must be multiples of 16, its weight untied and its name outside strategy.float8.keep_high_precision): "
                "the run would train in high precision; use dims that are multiples of 16 (model.dim, model.ffn_dim), "
                "or strategy.float8.recipe=null"
            )
        if run.adapters:
            out.append(
                "strategy.float8 does not compose with strategy.lora yet (the adapters wrap plain Linear "
                "layers); use strategy.float8.recipe=null"
            )
        return out

    def _converted(self, shape: ModelShape) -> list[str]:
        """The Linear layers of ``shape`` that `apply` would convert (tied weights are not in its params)."""
        specs = {spec.name: spec for spec in shape.params}
        return [
            fqn for fqn in shape.linear_modules
            if (spec := specs.get(f"{fqn}.weight")) is not None and eligible(fqn, spec.shape, self.keep_high_precision)
        ]  # fmt: skip

    def _kernel_shape_problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """What ``torch._scaled_mm`` (the GPU's float8 GEMM) cannot take: its inner and output dims must
        be multiples of 16, only the rows are free. That is both dims of every float8 layer's weight as
        one rank holds it (`converts` checks the whole weight; tensor parallelism splits one dim), and
        the tokens of one forward on one rank (the inner dim of the weight gradient's GEMM): micro-batch
        rows (2 per preference pair; as few as 1 in a last, partial batch unless data.drop_last) x
        data.seq_len / cp, pipeline micro-batches included (each holds a micro-batch)."""
        out, tp, cp = [], run.dims.tp, run.dims.cp
        specs = {spec.name: spec for spec in (shape.params if shape is not None else ())}
        converted = self._converted(shape) if shape is not None else []
        narrow = {}
        for fqn in converted:
            spec = specs[f"{fqn}.weight"]
            local = [n // tp if dim == spec.tp_dim else n for dim, n in enumerate(spec.shape)]
            if any(n % 16 for n in local):
                narrow.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), tuple(local))
        if narrow:
            shown = ", ".join(f"{name} {list(dims)}" for name, dims in narrow.items())
            keep = ",".join([*self.keep_high_precision, *narrow])
            out.append(
                f"strategy.float8 on a GPU needs each float8 layer's weight, as one of the strategy.tp={tp} ranks "
                f"holds it, to have dims that are multiples of 16 (torch._scaled_mm): {shown}; keep them in high "
                f"precision, strategy.float8.keep_high_precision='[{keep}]', or lower strategy.tp"
            )
        per_row = 2 if run.row_kind == "pairs" else 1  # a pair's chosen and rejected rows share one forward
        rows = per_row * (run.micro_batch_size if run.drop_last else 1)
        tokens = rows * run.seq_len // cp
        if converted and run.seq_len and tokens % 16:
            rows_text = f"{rows} row{'s' if rows > 1 else ''}" + (
                "" if run.drop_last else " (data.drop_last=false: a last, partial batch may hold a single pair or row)"
            )
            out.append(
                f"strategy.float8 on a GPU needs the tokens of one forward on one rank to be a multiple of 16 (the "
                f"weight gradient's float8 GEMM sums over them: torch._scaled_mm): {rows_text} x data.seq_len="
                f"{run.seq_len}{f' / strategy.cp={cp}' if cp > 1 else ''} = {tokens}; use a data.seq_len that is a "
                f"multiple of {16 * cp}{'' if run.drop_last else ', or data.drop_last=true'}"
            )
        return out

    def apply(self, model: nn.Module, meshes: Meshes) -> list[str]:
        """Converts ``model``'s chosen Linear layers (emulated unless ``meshes.device`` is CUDA);
        returns their names."""
        emulate = self.emulate if self.emulate is not None else meshes.device.type != "cuda"
        sharded = meshes.fsdp.shape[-1] > 1  # FSDP shards (dp_shard x cp > 1): weights are all-gathered
        if self.fsdp_float8_all_gather is None:  # not with power-of-2 scales: the all-gather's are not rounded
            self._all_gather = self.recipe == "tensorwise" and sharded and not self.power_of_2_scales
        else:
            self._all_gather = self.fsdp_float8_all_gather and sharded
        linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        chosen = apply_float8(
            model,
            recipe=self.recipe,
            keep_high_precision=self.keep_high_precision,
            emulate=emulate,
            fsdp_float8_all_gather=self._all_gather,
            round_scales_to_power_of_2=self.round_scales_to_power_of_2,
        )
        how = "emulated in fp32" if emulate else "float8 kernels"
        gather = "; weights all-gathered in float8" if self._all_gather else ""
        # One scale per tensor: a forward of fewer rows (a dp rank's, a micro-batch's) scales them on its own.
        rows = "; one activation scale per forward, so the numbers follow each forward's rows" * (
            self.recipe == "tensorwise"
        )
        self.say(
            f"float8 ({self.recipe}, {how}): {len(chosen)} of the {linear} Linear layers; the others in high "
            f"precision{gather}{rows}"
        )
        return chosen

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The next step's float8 weight scales, from the updated weights (float8 all-gather only)."""
        if self._all_gather:
            precompute_float8_scales(model)
        return {}

    def after_load(self, model: nn.Module) -> None:
        """The scales of the loaded weights (float8 all-gather only): after a rollback, the ones
        precomputed last were the discarded weights'."""
        if self._all_gather:
            precompute_float8_scales(model)
