"""QLoRA's base: the adapted linear layers' frozen weights in 4-bit NormalFloat (NF4) through
bitsandbytes (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314; ``bitsandbytes.functional.quantize_4bit`` / ``matmul_4bit``, which have a CPU
backend; the forward equals ``bitsandbytes.nn.Linear4bit``'s).

Each layer is replaced by an `NF4Linear` holding the quantised weight under the same name
(``...wq.weight``), its adapters moved over with their hook, so the adapter parameters and the
optimizer that holds them are unchanged. The packed weight is stored in a float dtype
(``quant_storage=float32``), not uint8: FSDP-style flattening of mixed uint8 / float parameters
is known to corrupt training silently (bitsandbytes' FSDP-QLoRA notes). Its ``QuantState`` lives
on the module, so FSDP2, which replaces parameters, keeps it: under FSDP2 each layer's codes are
their own unit (gathered without a mixed-precision cast). Matmuls run in the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

QUANT_TYPES = ("nf4",)
BLOCKSIZE = 64  # weights per absmax (bitsandbytes' default for 4-bit)
STORAGE = torch.float32  # packed codes' dtype: a float, so FSDP2 shards them like the other parameters
_ADAPTER_ATTRS = ("lora_A", "lora_B", "lora_dropout", "lora_scaling")


class NF4Linear(nn.Linear):
    """A frozen linear layer whose weight is NF4 codes packed two per byte in float32 storage
    (``weight``: [out * in / 8, 1] float32 holding [out, in] 4-bit codes), with its bitsandbytes
    ``QuantState`` (absmax per 64-weight block, the NF4 code book, the [out, in] shape) kept on the
    module, not on the parameter. FSDP2 can then shard and all-gather ``weight`` like any float
    parameter (it replaces parameters, which drops attributes such as ``Params4bit.quant_state``),
    and the forward (``bitsandbytes.matmul_4bit`` with the module's state) reads whatever tensor the
    parameter is at call time: the all-gathered one under FSDP2.

    Raises:
        ImportError: bitsandbytes is not installed (the message names the install).
    """

    def __init__(self, module: nn.Linear) -> None:
        try:
            import bitsandbytes.functional as bnbf  # optional dependency: pip install plait[qlora]
        except ImportError:
            raise ImportError("strategy.lora.quantize=nf4 needs bitsandbytes: pip install bitsandbytes") from None
        nn.Module.__init__(self)
        self.in_features, self.out_features = module.in_features, module.out_features
        packed, self.quant_state = bnbf.quantize_4bit(
            module.weight.detach().to(torch.float32),
            blocksize=BLOCKSIZE,
            compress_statistics=False,
            quant_type="nf4",
            quant_storage=STORAGE,
        )
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().clone(), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out, in]`` weight in ``dtype`` that `forward` multiplies by (bitsandbytes' own dequantisation)."""
        import bitsandbytes.functional as bnbf  # optional dependency (plait[qlora]), there once quantized

        self.quant_state.dtype = dtype
        return bnbf.dequantize_4bit(self.weight, self.quant_state)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]: x W^T (+ b), W dequantised from the module's state (in x's dtype)."""
        import bitsandbytes as bnb  # optional dependency (plait[qlora]), there once quantized

        self.quant_state.dtype = x.dtype
        return bnb.matmul_4bit(x, self.weight.t(), quant_state=self.quant_state, bias=self.bias)


def quantize_linear(module: nn.Linear, *, hook: Callable[..., Any]) -> nn.Module:
    """`NF4Linear` of ``module``'s weight, with its LoRA adapters (moved, not copied) and forward ``hook``."""
    layer = NF4Linear(module)
    for name in _ADAPTER_ATTRS:
        setattr(layer, name, getattr(module, name))
    layer.lora_hook = layer.register_forward_hook(hook)
    return layer


def quantize_layers(
    model: nn.Module,
    names: list[str],
    *,
    hook: Callable[..., Any],
    shard: Callable[[nn.Module, set[nn.Parameter]], None] | None = None,
) -> None:
    """Replaces each named layer of ``model`` by its `quantize_linear` form, in place; ``shard``
        (FSDP2's, when the model is sharded) then shards each new layer's packed weight (and bias) as its
    own unit, leaving out the given parameters: the adapters, which their block's unit shards already.
        Under FSDP2 the float weights being replaced are FSDP's ``ignored_params`` (whole on every rank),
        so each rank quantises the whole layer and the new unit keeps its own slice of the codes.
    """
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = owner.get_submodule(leaf)
        old.lora_hook.remove()
        layer = quantize_linear(old, hook=hook)
        setattr(owner, leaf, layer)
        if shard is not None:
            shard(layer, {p for child in layer.children() for p in child.parameters()})
