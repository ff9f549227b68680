"""Meta-device construction: a model built on the meta device, allocated at its sharded size.

The recipe of torchtitan (build on meta, parallelize, ``to_empty``, ``init_weights``): no rank ever
holds the whole model.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from strategies.core.model_contract import declares, member_problem
from strategies.transforms.ties import keep_ties


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is still on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocates a model built on the meta device on ``device``, each parameter at its local
    (sharded) size, and fills it with ``model.init_weights()``; nothing for a real model.

    ``init_weights`` must give every layout the same values (plait's Llama seeds each weight by its
    name: `trainer.models.init`). Weights tied on the meta device are one tensor after it
    (`strategies.transforms.ties.keep_ties`): ``to_empty`` gives each plain (non-DTensor) parameter slot a new
    tensor of its own, which untied the LM head under local SGD without FSDP.

    Raises:
        TypeError: a model on the meta device without an ``init_weights()`` method.
    """
    if not is_meta(model):
        return
    if not declares(model, "init_weights"):
        raise TypeError(member_problem(model, ["init_weights"], "built on the meta device (META_INIT)"))
    with keep_ties(model):  # before init_weights, which then fills a tied tensor once
        model.to_empty(device=device)
    model.init_weights()
