"""Seeded initialisation per parameter name: the same weights at any world size and layout.

Each parameter is drawn from its own generators, seeded by (the model's seed, the parameter's
name, a block of its rows), so a rank can fill only the shard it holds, after the model was built
on the meta device and parallelized (the meta-device construction of torchtitan's
``init_weights`` after ``to_empty``), and still hold exactly the values that a one-process model
would: the blocks cut dim 0 at places fixed by the shape alone, a rank draws the blocks that cover
its rows and keeps its box. A DTensor's box is where DCP places it (``compute_local_shape_and_global_offset``).

Values depend on the device type of the generator (CPU and CUDA draw different streams): every
layout on one device type gets the same weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

BLOCK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per generated block: the transient of an init


def name_seed(seed: int, name: str, block: int = 0) -> int:
    """A 63-bit generator seed for block ``block`` of parameter ``name`` (stable across runs and processes)."""
    key = zlib.crc32(f"{name}#{block}".encode())
    return (seed * 0x9E3779B97F4A7C15 + key) % (1 << 63)


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """This rank's part of ``param`` as slices of the global tensor (all of it for a plain tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def seeded_normal_(param: torch.Tensor, name: str, *, std: float, seed: int) -> None:
    """Fills ``param`` (a tensor or a DTensor's local shard) with N(0, std) drawn per name and row block.

    Raises:
        ValueError: ``param`` is on the meta device (materialise it first, e.g. ``to_empty``).
    """
    _fill_blocks(param, name, seed, lambda block, g: block.normal_(0.0, std, generator=g))


@torch.no_grad()
def _fill_blocks(
    param: torch.Tensor, name: str, seed: int, draw: Callable[[torch.Tensor, torch.Generator], None]
) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.is_meta:
        raise ValueError(f"parameter {name} is on the meta device: materialise the model (to_empty) before init")
    box = local_box(param)
    if local.numel() == 0:
        return
    rows = param.shape[0] if param.dim() else 1
    row_numel = max(1, param.numel() // max(rows, 1))
    per_block = max(1, BLOCK_ELEMENTS // row_numel)
    first, stop = (box[0].start, box[0].stop) if param.dim() else (0, 1)
    g = torch.Generator(device=local.device)
    for block in range(first // per_block, -(-stop // per_block)):
        lo, hi = block * per_block, min((block + 1) * per_block, rows)
        values = torch.empty((hi - lo, *param.shape[1:]), dtype=torch.float32, device=local.device)
        g.manual_seed(name_seed(seed, name, block))
        draw(values, g)
        a, b = max(lo, first), min(hi, stop)
        piece = values[(slice(a - lo, b - lo), *box[1:])] if param.dim() else values.reshape(())
        target = local[a - first : b - first] if param.dim() else local
        target.copy_(piece)
