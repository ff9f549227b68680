"""Tied weights across a transformation that replaces a module's tensors: one tensor before, one after.

A model ties two weights by holding one ``nn.Parameter`` under two names (Llama's
``tok_embeddings.weight`` and ``output.weight`` with ``tie_embeddings=True``; Press & Wolf 2017,
"Using the Output Embedding to Improve Language Models"). ``nn.Module._apply`` visits each
module's parameter slots one by one, and where it cannot change a tensor in place it stores a new
``Parameter`` in each slot: ``to_empty`` from the meta device to a real one (``_apply`` uses
``param.data = ...`` only between compatible tensor types, and swaps only tensor subclasses such
as DTensor), and DTensor's ``parallelize_module``, which distributes each module's parameters on
their own. Each alias then gets a tensor of its own, and training updates them apart. torchtitan
and Hugging Face re-point the head at the embedding by name after such steps (``tie_weights``);
`keep_ties` does it for any model, by identity: the slots that held one tensor before hold the
first slot's tensor after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Slot = tuple[str, str]  # (module FQN, attribute name): where a parameter or buffer is held


def tied_slots(model: nn.Module) -> list[list[Slot]]:
    """The groups of slots (at least two each) of ``model`` that hold one tensor, in
    ``named_modules`` order (the first slot of a group is the name a one-process model keeps:
    ``tok_embeddings.weight`` before ``output.weight``)."""
    by_id: dict[int, list[Slot]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        own = (
            module.named_parameters(recurse=False, remove_duplicate=False),
            module.named_buffers(recurse=False, remove_duplicate=False),
        )
        for attr, tensor in (pair for named in own for pair in named):
            by_id.setdefault(id(tensor), []).append((module_name, attr))
    return [slots for slots in by_id.values() if len(slots) > 1]


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    placements = (t.device_mesh, t.placements) if isinstance(t, DTensor) else ()
    return (type(t), tuple(t.shape), t.dtype, t.device, *placements)


def _name(slot: Slot) -> str:
    return f"{slot[0]}.{slot[1]}" if slot[0] else slot[1]


def retie(model: nn.Module, groups: list[list[Slot]]) -> None:
    """Points every slot of each group at the tensor its first slot holds now, in place.

    Raises:
        ValueError: the slots of a group now hold tensors of different shapes, dtypes, devices
            or DTensor placements (a plan that shards two tied weights differently cannot keep
            them one tensor; the message names both).
    """
    for group in groups:
        first = group[0]
        tensors = [getattr(model.get_submodule(module_name), attr) for module_name, attr in group]
        for slot, tensor in zip(group[1:], tensors[1:]):
            if tensor is tensors[0]:
                continue
            if _layout(tensor) != _layout(tensors[0]):
                raise ValueError(
                    f"{_name(first)} and {_name(slot)} are one tied tensor, but are now laid out apart "
                    f"({_layout(tensors[0])} vs {_layout(tensor)}); give both the same parallel plan, or untie them "
                    "(model.tie_embeddings=false)"
                )
            setattr(model.get_submodule(slot[0]), slot[1], tensors[0])  # a Parameter / buffer slot stays one


@contextmanager
def keep_ties(model: nn.Module) -> Iterator[None]:
    """Records the tied slots of ``model`` on entry and re-ties them on exit (`retie`): weights
    shared before the block are one tensor after it, whatever the block replaced."""
    groups = tied_slots(model)
    yield
    retie(model, groups)
