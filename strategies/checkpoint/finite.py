"""Whether a checkpoint's state is finite: the check every save makes before it writes and every load after it reads.

A NaN or inf in the weights or the optimizer moments would be written and resumed from; plait
refuses both (`strategies.checkpoint.dcp`). The check costs one reduction pass per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every tensor and float in a nested state; DTensors as their local shard."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from tensors(value, f"{prefix}{key}.")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from tensors(value, f"{prefix}{i}.")
    elif isinstance(state, DTensor):
        yield prefix[:-1], state.to_local()
    elif isinstance(state, (torch.Tensor, float)):
        yield prefix[:-1], state


def non_finite_entry(state: dict[str, Any]) -> str | None:
    """The key of the first NaN or inf in this rank's part of ``state``, or None."""
    keys, flags = [], []
    for key, value in tensors(state):
        if isinstance(value, float):
            if not math.isfinite(value):
                return key
        elif value.is_floating_point() and value.numel():
            keys.append(key)
            flags.append(_all_finite(value))
    if not flags:
        return None
    bad = (~torch.stack([f.to(flags[0].device) for f in flags])).nonzero().flatten().tolist()  # one host sync
    return keys[bad[0]] if bad else None


def _all_finite(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: ``value`` holds no NaN or inf. Through its min and max (NaN propagates into
    both): one reduction pass, where ``isfinite(value).all()`` first writes a mask as large as ``value``
    (20x slower on CPU; most of a background save's blocked time)."""
    if value.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return torch.isfinite(torch.stack(torch.aminmax(value))).all()
    return torch.isfinite(value).all()
