"""Checkpoints hold plain tensors: a wrapper tensor subclass around one tensor is saved as that tensor.

Under FSDP2's float8 all-gather (`strategies.float8`), torchao keeps each converted weight's shard as a
``WeightWithDynamicFloat8CastTensor``: a subclass that wraps the fp32 shard itself (``_tensor``, the
same shape and dtype) and casts it to float8 when FSDP gathers it. DCP's file writer pickles a
tensor's class with its bytes, so such a checkpoint could be read back only where torchao had
registered the class as safe (a resumed float8 run): ``plait export``, ``eval``, ``generate`` and
``model.init_from`` refused it (``weights_only`` unpickling, `strategies.checkpoint.safe_load`).
Saving the wrapped tensor instead keeps the same values and storage (a load into it fills the
parameter in place), and the file is a plain one for every reader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map


def wrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The one inner tensor of a wrapper subclass of the same shape and dtype (``__tensor_flatten__``
    names it); ``tensor`` itself otherwise (plain tensors, subclasses holding several tensors such as
    a 4-bit NF4 weight's codes and scales). A DTensor keeps its mesh and placements around it."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        inner = wrapped(local)
        if inner is local:
            return tensor
        return DTensor.from_local(
            inner, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not is_traceable_wrapper_subclass(tensor):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    if len(names) != 1:
        return tensor
    inner = getattr(tensor, names[0])
    return inner if inner.shape == tensor.shape and inner.dtype == tensor.dtype else tensor


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model's or optimizer's state dict, nested) with every tensor `wrapped`."""
    return tree_map(lambda v: wrapped(v) if isinstance(v, torch.Tensor) else v, state)
