"""This rank's shards of state trees and back: what a replica group sends a recovering peer
(`strategies.fault_tolerance`) is plain local tensors; the receiver lays them out like its own
DTensor parameters again (FSDP's shards)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an alias: in-place changes reach the DTensor), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_tree(tree: Any) -> Any:
    """``tree`` (dicts and lists) with each DTensor replaced by this rank's shard."""
    if isinstance(tree, dict):
        return {key: local_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(value) for value in tree)
    return local(tree) if isinstance(tree, torch.Tensor) else tree


def like_param(value: Any, param: torch.Tensor) -> Any:
    """A peer's shard laid out like ``param``: a DTensor of its placements when ``param`` is one and
    ``value`` has its local shape (FSDP's shards), else ``value``."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with each DTensor replaced by this rank's shard."""
    return {
        "state": {k: {n: local(v) for n, v in s.items()} for k, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def placed_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A peer's `local_state` laid out like ``optimizer``'s parameters: a value of a DTensor
    parameter's local shape becomes a DTensor of its placements (FSDP's shards)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed = {
        key: {name: like_param(value, params[int(key)]) for name, value in values.items()}
        for key, values in state["state"].items()
    }
    return {"state": placed, "param_groups": state["param_groups"]}
