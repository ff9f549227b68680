"""QLoRA's base: the adapted linear layers' frozen weights in 4-bit NormalFloat (NF4) through
bitsandbytes (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314; ``bitsandbytes.nn.Linear4bit``, which has a CPU backend).

Each layer is replaced by a ``Linear4bit`` holding the same quantised weight under the same name
(``...wq.weight``), its adapters moved over with their hook, so the adapter parameters and the
optimizer that holds them are unchanged. The packed weight is stored in a float dtype
(``quant_storage=float32``), not uint8: FSDP-style flattening of mixed uint8 / float parameters
is known to corrupt training silently (bitsandbytes' FSDP-QLoRA notes). Matmuls run in the
adapters' dtype (fp32 on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

QUANT_TYPES = ("nf4",)
_ADAPTER_ATTRS = ("lora_A", "lora_B", "lora_dropout", "lora_scaling")


def quantize_linear(module: nn.Linear, *, hook: Callable[..., Any]) -> nn.Module:
    """A bitsandbytes ``Linear4bit`` (NF4, float storage) with ``module``'s weight quantised and its
    LoRA adapters (moved, not copied) and forward ``hook``.

    Raises:
        ImportError: bitsandbytes is not installed (the message names the install).
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImportError("strategy.lora.quantize=nf4 needs bitsandbytes: pip install bitsandbytes") from None
    device = module.weight.device
    storage = torch.float32
    layer = bnb.nn.Linear4bit(
        module.in_features, module.out_features, bias=module.bias is not None, compute_dtype=torch.float32,
        compress_statistics=False, quant_type="nf4", quant_storage=storage, device="cpu",
    )  # fmt: skip
    layer.weight = bnb.nn.Params4bit(
        module.weight.detach().to("cpu", torch.float32), requires_grad=False, quant_type="nf4",
        compress_statistics=False, quant_storage=storage, module=layer,
    )  # fmt: skip
    # bitsandbytes 0.50 repacks the weight for its AVX512-bf16 kernel in eval mode without grad,
    # and that repacking fails for layers narrower than a few blocks (absmax reshape error).
    layer.support_avx512bf16_for_cpu = False
    if module.bias is not None:
        layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    layer = layer.to(device)  # bitsandbytes quantises on the move (on the CPU too)
    for name in _ADAPTER_ATTRS:
        setattr(layer, name, getattr(module, name))
    layer.lora_hook = layer.register_forward_hook(hook)
    return layer


def quantize_layers(model: nn.Module, names: list[str], *, hook: Callable[..., Any]) -> None:
    """Replaces each named layer of ``model`` by its `quantize_linear` form, in place."""
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = owner.get_submodule(leaf)
        old.lora_hook.remove()
        setattr(owner, leaf, quantize_linear(old, hook=hook))


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The float weight of a quantised layer (``module.weight`` of a plain one)."""
    weight = module.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:
        return weight
    import bitsandbytes.functional as F

    return F.dequantize_4bit(weight.data, quant_state)
