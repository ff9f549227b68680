"""LoRA: low-rank adapters on chosen linear layers of a frozen base (Hu et al. 2021, "LoRA:
Low-Rank Adaptation of Large Language Models", arXiv:2106.09685).

Each target ``nn.Linear`` y = x W^T keeps its weight and gains two child layers, ``lora_A``
(r x in) and ``lora_B`` (out x r), and a forward hook adding ``(alpha / r) * B(A(dropout(x)))``.
Hooks, not a wrapper module: the base parameters keep their names (``layers.0.attention.wq.weight``),
so ``model.init_from``, tensor parallelism's plan and the Hugging Face export find them unchanged,
and the adapter names (``...wq.lora_A.weight``) are PEFT's. A starts Kaiming-uniform (PEFT's
default), B at zero, so the adapted model starts equal to the base.

Under tensor parallelism (applied before, so the base weights are DTensors) the adapters are
DTensors on the same mesh: for a column-wise weight (Shard(0)) A is replicated and B is
Shard(0); for a row-wise one (Shard(1)) A is Shard(1) and B replicated, and the rank-r partial
sum x A^T is reduced to the base output's placement (a reduce-scatter of b x s x r values, not
of b x s x out). FSDP2 (applied after) shards the adapters with their block; the frozen base
gets no gradients and no optimizer state.

The hook runs only when the layer is called. Code that multiplies by a layer's weight itself
(SAT's sliced MLP, the chunked LM-head loss) calls `linear_slice` / `linear_operands` instead,
which add the adapter (and dequantise a QLoRA base) the same way.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from strategies.plugin import StrategyPlugin
from strategies.runtime.terminal import write_line
from strategies.transforms.lora_targets import (
    is_adapter,
    linear_layers,
    lora_targets,
    selects,
    target_problems,
    unadaptable,
)
from strategies.transforms.qlora import QUANT_TYPES, NF4Linear, quantize_layers

if TYPE_CHECKING:
    from strategies.core.parallel_dims import Meshes
    from strategies.core.resolved import ResolvedRun
    from strategies.core.shape import ModelShape

DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def _placements(weight: torch.Tensor) -> tuple[Any, Any] | None:
    """(A's, B's) placement for a tensor-parallel ``weight`` [out, in]; None for a plain tensor."""
    if not isinstance(weight, DTensor):
        return None
    (placement,) = weight.placements
    if placement == Shard(0):  # column-wise: output features sharded
        return Replicate(), Shard(0)
    if placement == Shard(1):  # row-wise: input features sharded
        return Shard(1), Replicate()
    return Replicate(), Replicate()


def _output_placement(global_shape: torch.Size, local_shape: torch.Size) -> Any:
    """The placement whose local shard of ``global_shape`` has ``local_shape`` (leading dims)."""
    for dim, (full, local) in enumerate(zip(global_shape, local_shape)):
        if full != local:
            return Shard(dim)
    return Replicate()


def _lora_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a target layer: output + scaling * B(A(dropout(x)))."""
    h = module.lora_A(module.lora_dropout(args[0]))
    if isinstance(h, DTensor) and any(p.is_partial() for p in h.placements):
        # Row-wise base: reduce the rank-r partial sums straight to the output's placement.
        target = (
            output.placements[0] if isinstance(output, DTensor) else _output_placement(h.shape[:-1], output.shape[:-1])
        )
        h = h.redistribute(placements=[target])
    delta = module.lora_B(h) * module.lora_scaling
    if isinstance(delta, DTensor) and not isinstance(output, DTensor):
        delta = delta.redistribute(placements=[_output_placement(delta.shape, output.shape)]).to_local()
    return output + delta


def _adapter(full: torch.Tensor, like: torch.Tensor, placement: Any | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``full`` ([out, in]) as its weight, a DTensor on ``like``'s mesh if given a placement."""
    layer = nn.Linear(full.shape[1], full.shape[0], bias=False, device="meta")
    device = like.to_local().device if isinstance(like, DTensor) else like.device
    weight = full.to(device=device)
    if placement is not None:
        weight = distribute_tensor(weight, like.device_mesh, [placement])
    layer.weight = nn.Parameter(weight)
    return layer


@torch.no_grad()
def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    seed: int = 0,
    quantize: str | None = None,
) -> list[str]:
    """Freezes every parameter of ``model`` and adds adapters to its target linear layers, in place.

    A is drawn from ``torch.Generator().manual_seed(seed)``, one Kaiming-uniform [r, in] tensor
    per target in ``named_modules`` order (bound 1/sqrt(in)), the same on every rank; B is zero.

    Args:
        rank: r, the adapters' inner dimension.
        alpha: the scaling numerator: the update is (alpha / r) B A.
        dropout: dropout probability on the adapters' input (training mode only).
        target_modules: name patterns of the layers to adapt (see `lora_targets`).
        seed: seed of A's initialisation.
        quantize: "nf4": QLoRA, the adapted layers' base weights in 4-bit NF4
            (`strategies.transforms.qlora`), quantised at the model's first forward, once ``model.init_from``
            has loaded them (the plugins are applied before the weights load); None: float base.

    Returns:
        The FQNs of the adapted layers.

    Raises:
        ValueError: a pattern of ``target_modules`` selects no linear layer (`target_problems`).
    """
    problems = target_problems([n for n, _ in linear_layers(model)], target_modules)
    if problems:
        raise ValueError(problems[0])
    targets = lora_targets(model, target_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for _, module in targets:
        weight = module.weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        a_full = torch.empty(rank, module.in_features, dtype=dtype)
        nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=generator)
        b_full = torch.zeros(module.out_features, rank, dtype=dtype)
        a_place, b_place = _placements(weight) or (None, None)
        module.lora_A = _adapter(a_full, weight, a_place)
        module.lora_B = _adapter(b_full, weight, b_place)
        module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        module.lora_scaling = alpha / rank
        module.lora_hook = module.register_forward_hook(_lora_hook)
    names = [name for name, _ in targets]
    if quantize is not None:
        model.lora_quantize_names = names
        model.lora_quantize_hook = model.register_forward_pre_hook(lambda root, args: quantize_pending(root))
    return names


def quantize_pending(model: nn.Module) -> None:
    """Quantises the base of a QLoRA ``model`` now (once its weights are loaded); nothing for a
    model without pending quantisation. Under FSDP2 (``model.lora_shard``, set by
    `strategies.fsdp.FSDP.apply`) it must run before the first forward: each new 4-bit layer becomes
    an FSDP unit, which the root collects at its first forward."""
    if not hasattr(model, "lora_quantize_hook"):
        return
    model.lora_quantize_hook.remove()
    del model.lora_quantize_hook
    quantize_layers(model, model.lora_quantize_names, hook=_lora_hook, shard=getattr(model, "lora_shard", None))
    del model.lora_quantize_names


def quantize_later(model: nn.Module) -> list[nn.Parameter]:
    """The float weights a QLoRA ``model`` will replace by 4-bit codes (`quantize_pending`): FSDP2
    leaves them unsharded (``ignored_params``) until then. Empty without pending quantisation."""
    return [model.get_submodule(name).weight for name in getattr(model, "lora_quantize_names", ())]


def is_adapted(layer: nn.Module) -> bool:
    """Whether ``layer`` carries adapters (`apply_lora`)."""
    return isinstance(layer, nn.Linear) and hasattr(layer, "lora_hook")


def adapted_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers of ``model`` that carry adapters (`apply_lora`), with their FQNs."""
    return [(name, m) for name, m in model.named_modules() if is_adapted(m)]


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Runs ``model`` as its frozen base: every adapter's scaling is 0 inside (its output adds an
    exact 0), restored on exit. The reference model of an objective that needs one (GRPO's KL
    term) without a second copy of the weights, as TRL does with PEFT's ``disable_adapter``.

    Raises:
        ValueError: ``model`` carries no adapters.
    """
    layers = [layer for _, layer in adapted_layers(model)]
    if not layers:
        raise ValueError("the model carries no LoRA adapters, so it has no frozen base to switch to")
    scalings = [layer.lora_scaling for layer in layers]
    for layer in layers:
        layer.lora_scaling = 0.0
    try:
        yield
    finally:
        for layer, scaling in zip(layers, scalings):
            layer.lora_scaling = scaling


# ---------------------------------------------------------------------------------------------- weight reads
# The adapter lives in a forward hook, so code that multiplies by ``layer.weight`` itself instead of
# calling the layer skips it (and a QLoRA base's ``weight`` holds packed 4-bit codes). Such code
# calls these two functions: the only places besides the hook that know how an adapted layer computes.


def dense_weight(layer: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The base ``[out, in]`` weight of ``layer``: its parameter, or a QLoRA layer's NF4 codes
    dequantised (in ``dtype``, default float32), exactly what its forward multiplies by."""
    if isinstance(layer, NF4Linear):
        return layer.dequantized(dtype or torch.float32)
    return layer.weight


def linear_slice(
    layer: nn.Linear, x: torch.Tensor, *, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer(x)`` computed on a slice of its features only, the adapter (if any) sliced alike.

    With ``rows`` ([F'] int64) the output keeps only those output features: ``x W[rows]^T`` plus
    ``s B[rows] A dropout(x)``. With ``cols`` (int64) ``x`` holds only those input features
    (``[..., len(cols)]``): ``x W[:, cols]^T`` plus ``s B A[:, cols] dropout(x)``. Both may be given.
    This is `strategies.transforms.sat`'s omission of MLP channels (`trainer.models.block.FeedForward`):
    gate/up projections by rows, the down projection by columns.

    Args:
        layer: a linear layer, adapted or not (plain tensors: not tensor-parallel).
        x: ``[..., in]`` or ``[..., len(cols)]``.

    Returns:
        ``[..., out]`` or ``[..., len(rows)]``.
    """
    weight, bias = dense_weight(layer, x.dtype), layer.bias
    if rows is not None:
        weight, bias = weight[rows], None if bias is None else bias[rows]
    if cols is not None:
        weight = weight[:, cols]
    y = F.linear(x, weight, bias)
    if not is_adapted(layer):
        return y
    a, b = layer.lora_A.weight, layer.lora_B.weight
    a = a if cols is None else a[:, cols]
    b = b if rows is None else b[rows]
    return y + F.linear(F.linear(layer.lora_dropout(x), a), b) * layer.lora_scaling


def linear_operands(layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x2, w2)`` with ``x2 @ w2.T == layer(x)``: one matmul for code that applies a layer's
    weight itself (the chunked LM-head loss, `trainer.objectives.chunked_loss`).

    A plain layer gives ``(x, W)``. An adapted one gives ``x2 = [x, s A dropout(x)]`` ``[..., in + r]``
    and ``w2 = [W, B]`` ``[out, in + r]``: the adapter's rank-r product rides in the same GEMM, so
    its gradients reach A and B, with its dropout drawn as the hook draws it. The price: an adapted
    layer's W is copied once per call (into ``w2``).

    Raises:
        ValueError: ``layer`` has a bias (a single matmul has none).
    """
    if layer.bias is not None:
        raise ValueError(f"{type(layer).__name__} with a bias cannot be applied as one matmul; call the layer")
    weight = dense_weight(layer, x.dtype)
    if not is_adapted(layer):
        return x, weight
    low_rank = layer.lora_A(layer.lora_dropout(x)) * layer.lora_scaling
    return torch.cat([x, low_rank.to(x.dtype)], dim=-1), torch.cat(
        [weight, layer.lora_B.weight.to(weight.dtype)], dim=1
    )


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Folds every adapter into its base weight (W += (alpha / r) B A) and removes it, in place.

    One process, plain tensors (an exported model). A QLoRA model merges into its float base, so
    before its first forward (as `trainer.run_model.load_run_model` returns it); its pending
    quantisation is dropped. Returns the number of merged layers.

    Raises:
        ValueError: the base is quantised already, or an adapted layer's weight is shared with
            another module (a tied output head: the merge would change the input embedding too).
            Nothing is changed then.
    """
    layers = adapted_layers(model)
    if any(hasattr(m, "quant_state") for _, m in layers):
        raise ValueError("the base is 4-bit already; merge a QLoRA model before its first forward (its float base)")
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shared = [name for name, m in layers if owners[id(m.weight)] > 1]
    if shared:
        raise ValueError(
            f"the adapted {', '.join(shared)} share their weight with another layer (tied embeddings): merging "
            "would change that layer too; train without them in strategy.lora.target_modules"
        )
    if hasattr(model, "lora_quantize_hook"):
        model.lora_quantize_hook.remove()
        del model.lora_quantize_hook, model.lora_quantize_names
    for _, module in layers:
        delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * module.lora_scaling
        module.weight.add_(delta.to(module.weight.dtype))
        module.lora_hook.remove()
        for name in ("lora_A", "lora_B", "lora_dropout", "lora_hook", "lora_scaling"):
            delattr(module, name)
    return len(layers)


def trainable_bytes(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter bytes of ``model`` (global sizes: DTensors count whole)."""
    params = list(model.parameters())
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    return size([p for p in params if p.requires_grad]), size(params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state (global sizes: DTensors count whole)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def degree_problems(*, pp: int, tp: int, quantize: str | None, dropout: float) -> list[str]:
    """The parallel degrees LoRA does not run at (its check, and the planner's search): pipeline
    parallelism (not composed with adapters yet), tensor parallelism with QLoRA (the 4-bit codes are
    not DTensor-placed) or with adapter dropout (each tp rank would draw its own mask of a
    replicated input)."""
    out = []
    if pp > 1:
        out.append("strategy.lora does not compose with pipeline parallelism yet; use strategy.pp=1")
    if quantize is not None and tp > 1:
        out.append(
            f"strategy.lora.quantize={quantize} does not compose with tensor parallelism (the 4-bit codes "
            f"are not DTensor-placed); use strategy.tp=1 (FSDP2 shards them: strategy.dp_shard)"
        )
    if dropout > 0 and tp > 1:
        out.append(
            "strategy.lora.dropout>0 with strategy.tp>1 would draw a different mask per tp rank; use strategy.lora.dropout=0"
        )
    return out


@dataclass
class LoRA(StrategyPlugin):
    """The LoRA plugin (``strategy.lora``, off when null; preset ``+strategy/lora=default``).

    Applied after tensor and context parallelism and before activation checkpointing, compile
    and FSDP (`strategies.strategy_node.ORDER`), on materialized weights (``needs_real_weights``). Checkpoints then hold only the
    adapters (and their optimizer state): the base comes from ``model.init_from``.

    Args:
        rank: r of every adapter.
        alpha: scaling numerator (update = alpha / r * B A).
        dropout: dropout on the adapters' input.
        target_modules: name patterns of the adapted linear layers (PEFT's suffix rule or globs).
        seed: seed of the adapters' initialisation.
        quantize: "nf4" for QLoRA (the adapted layers' base in 4-bit NF4, bitsandbytes; one
            process or FSDP2, not TP); None: the base stays in its float dtype.
    """

    needs_real_weights = True  # its adapters are created beside real base weights
    conflicts = ("local_sgd",)

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    seed: int = 0
    quantize: str | None = None
    sizes: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # `report`'s, from the first step

    def problems(self, run: ResolvedRun, shape: ModelShape | None) -> list[str]:
        """Refuses a non-positive rank, dropout outside [0, 1), pipeline and local-SGD layouts
        (not composed with adapters yet), dropout under tp > 1 (each tp rank would draw its own
        mask of a replicated input), a target pattern that selects no linear layer of the model
        (`target_problems`), a tied output head as a target (its merge would change the embedding)
        and a run to launch without a base (``run.init_from``; a planned run needs only the shape)."""
        out = []
        if run.init_from is None and run.for_launch:
            out.append(
                "strategy.lora trains adapters on a frozen base, and its checkpoints hold only the adapters: set "
                "model.init_from=<a Hugging Face directory or a plait run> (the base)"
            )
        if shape is not None and shape.linear_modules:
            out.extend(target_problems(shape.linear_modules, self.target_modules))
            if shape.tie_embeddings and any(selects("output", p) for p in self.target_modules):
                out.append(
                    "strategy.lora.target_modules selects the output head, whose weight is the input embedding's "
                    "(tied embeddings): merging its adapter would change the embedding too; leave 'output' out of "
                    "strategy.lora.target_modules"
                )
        if self.rank < 1:
            out.append(f"strategy.lora.rank={self.rank} must be >= 1")
        if not 0 <= self.dropout < 1:
            out.append(f"strategy.lora.dropout={self.dropout} must be in [0, 1)")
        if self.quantize is not None:
            out.extend(self._quantize_problems())
        return out + degree_problems(pp=run.dims.pp, tp=run.dims.tp, quantize=self.quantize, dropout=self.dropout)

    def _quantize_problems(self) -> list[str]:
        if self.quantize not in QUANT_TYPES:
            return [f"strategy.lora.quantize={self.quantize} is unknown; use one of {', '.join(QUANT_TYPES)} or null"]
        if importlib.util.find_spec("bitsandbytes") is None:
            return ["strategy.lora.quantize=nf4 needs bitsandbytes: pip install bitsandbytes"]
        return []

    def attach(self, model: nn.Module) -> list[str]:
        """`apply_lora` with this plugin's settings (also used to rebuild a LoRA run's model)."""
        return apply_lora(
            model,
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            target_modules=tuple(self.target_modules),
            seed=self.seed,
            quantize=self.quantize,
        )

    def apply(self, model: nn.Module, meshes: Meshes) -> list[str]:
        """Adds the adapters to ``model`` (tensor-parallel already if tp > 1) and freezes the base."""
        return self.attach(model)

    def after_step(self, model: nn.Module, step: int, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """`report` after the first step (printed on global rank 0; a resumed run's first step
        too), then its values every step: they reach every row the loggers write
        (``trainer.log_every_n_steps``), which the first step's alone did not."""
        if not self.sizes:
            self.sizes = self.report(model, optimizer, verbose=not dist.is_initialized() or dist.get_rank() == 0)
        return self.sizes

    def saved_keys(self) -> Callable[[str], bool]:
        """Checkpoints hold only the adapters (the frozen base is ``model.init_from``'s, loaded again on resume)."""
        return is_adapter

    def report(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, verbose: bool) -> dict[str, float]:
        """What LoRA trains, after the first step (when the optimizer state exists): trainable and
        all parameter bytes, optimizer-state bytes (global sizes), printed once if ``verbose``.

        Returns:
            ``lora/trainable_bytes`` and ``lora/optimizer_state_bytes`` (bytes).
        """
        trainable, total = trainable_bytes(model)
        state = optimizer_state_bytes(optimizer)
        if verbose:
            write_line(
                f"plait: lora trains {trainable} of {total} parameter bytes ({100 * trainable / total:.2f}%); optimizer state {state} bytes"
            )
            if stacked := unadaptable(model, self.target_modules):
                write_line(
                    f"plait: lora: {len(stacked)} stacked expert weights that strategy.lora.target_modules names stay frozen "
                    f"(adapters go on nn.Linear layers only), e.g. {stacked[0]}"
                )
        return {"lora/trainable_bytes": float(trainable), "lora/optimizer_state_bytes": float(state)}
