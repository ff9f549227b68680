"""The hidden units of SwiGLU MLPs, as Independent Subnet Training splits them (`strategies.local_sgd.ist`):
a round's random split of every MLP's units into one group per island, the tensors indexed by unit
(gate/up rows, down-projection columns, and their optimizer state), and narrow pieces put back into
full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class SwiGLU(Protocol):
    """A SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))`` with ``ffn_dim`` hidden units (`trainer.models.block.FeedForward`)."""

    ffn_dim: int
    w1: nn.Linear
    w2: nn.Linear
    w3: nn.Linear


def split_units(ffn_dims: Sequence[int], num_islands: int, *, seed: int, round_index: int) -> list[list[torch.Tensor]]:
    """Each MLP's hidden units split into ``num_islands`` disjoint groups of equal size.

    One generator seeded by (``seed``, ``round_index``) draws a permutation per MLP, in order, so
    every island draws the same split. Returns ``[mlp][island]`` sorted int64 indices (units in
    their order in the full matrix).

    Raises:
        ValueError: an ``ffn_dim`` not divisible by ``num_islands``.
    """
    generator = torch.Generator().manual_seed((seed * 1_000_003 + round_index) % 2**63)
    out = []
    for ffn_dim in ffn_dims:
        if ffn_dim % num_islands:
            raise ValueError(f"ffn_dim={ffn_dim} is not divisible by {num_islands} islands")
        perm = torch.randperm(ffn_dim, generator=generator)
        out.append([group.sort().values for group in perm.chunk(num_islands)])
    return out


def unit_params(mlp: SwiGLU) -> list[tuple[nn.Parameter, int]]:
    """The parameters of ``mlp`` indexed by hidden unit, each with the dim of its units: the
    gate/up rows (and biases), the down projection's columns."""
    out = [(mlp.w1.weight, 0), (mlp.w3.weight, 0), (mlp.w2.weight, 1)]
    return out + [(layer.bias, 0) for layer in (mlp.w1, mlp.w3) if layer.bias is not None]


def widen(pieces: Sequence[torch.Tensor], groups: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full tensor whose units ``groups[i]`` (along ``dim``) are island i's narrow ``pieces[i]``."""
    shape = list(pieces[0].shape)
    shape[dim] = sum(len(g) for g in groups)
    full = torch.empty(shape, dtype=pieces[0].dtype, device=pieces[0].device)
    for piece, group in zip(pieces, groups):
        full.index_copy_(dim, group.to(full.device), piece)
    return full


def unit_state(optimizer: torch.optim.Optimizer | None, param: nn.Parameter) -> list[tuple[str, torch.Tensor]]:
    """The optimizer state tensors of ``param`` shaped like it (Adam's moments), by sorted key."""
    if optimizer is None:
        return []
    state = optimizer.state.get(param, {})
    return [(k, state[k]) for k in sorted(state) if torch.is_tensor(state[k]) and state[k].shape == param.shape]


def widened(tensor: torch.Tensor, dim: int, factor: int) -> torch.Tensor:
    """Zeros shaped like ``tensor`` with ``factor`` times its size along ``dim``."""
    shape = list(tensor.shape)
    shape[dim] *= factor
    return tensor.new_zeros(shape)
