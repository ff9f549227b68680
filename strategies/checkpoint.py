"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint is a directory::

    step_0000100/
      .metadata, __0_0.distcp, ...   # DCP: "model" and "optimizer_0" (resharded on load)
      meta.pt                        # Lightning's loop, scheduler, callback and data-loader state
      rng/rank_00000.pt ...          # per-rank Python, NumPy and torch RNG states

It is written to ``step_0000100.tmp`` and renamed once every rank has finished, so a crash during
a save leaves the previous checkpoint and the ``last`` link intact.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META_FILE = "meta.pt"

# Flattened optimizer state is keyed by parameter FQN. Without it "param_groups" is one DCP key,
# deduplicated across ranks that hold different parameters (pipeline stages), and resuming fails.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the path and the fix."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a complete checkpoint directory."""
    path = Path(path)
    return (path / ".metadata").is_file() and (path / META_FILE).is_file()


def save(
    path: Path,
    *,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    meta: dict[str, Any],
    extra: dict[str, Any] | None = None,
    namespace: str | None = None,
    keys: Callable[[str], bool] | None = None,
) -> None:
    """Collectively and atomically writes a checkpoint of ``model`` and ``optimizers`` to ``path``.

    Every rank calls it. ``meta`` (loop and scheduler state) is written by rank 0.

    Args:
        extra: more DCP state by top-level key (a strategy plugin's tensors and counters).
        namespace: the key this rank's "model" and "optimizer_i" go under; None: the top level.
            Ranks whose model state differs from rank 0's (local-SGD islands) keep their own.
        keys: which model state entries (FQNs) to write; None: all (LoRA: only the adapters).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a crash during an earlier save
    _barrier()
    dcp.save(_state(model, optimizers, extra, namespace, keys), checkpoint_id=tmp)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        torch.save(meta, tmp / META_FILE)
    _barrier()
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()


def load(
    path: Path,
    *,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any] | None = None,
    namespace: str | None = None,
    keys: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint written by `save` into ``model`` and ``optimizers``; returns ``meta``.

    Works at any world size and layout (DCP reshards). Each rank restores its own RNG state, or
    rank 0's when the checkpoint was written by fewer ranks. ``extra``, ``namespace`` and ``keys``
    as in `save` (the model entries outside ``keys`` keep their values); DCP loads ``extra`` in place (tensors are filled, other values replaced).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not is_checkpoint(path):
        raise CheckpointError(
            f"{path} is not a complete plait checkpoint (no .metadata or {META_FILE}); "
            f"point resume= at a step_* directory or a run directory with checkpoints/last"
        )
    state = _state(model, optimizers, extra, namespace, keys)
    dcp.load(state, checkpoint_id=path)
    if namespace is not None:
        state = state[namespace]
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=keys is None))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_OPTIM_OPTIONS)
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if not rng_file.exists():
        rng_file = path / "rng" / "rank_00000.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(path / META_FILE, weights_only=False)


def _model_state(model: nn.Module, keys: Callable[[str], bool] | None) -> dict[str, Any]:
    state = get_model_state_dict(model)
    return state if keys is None else {k: v for k, v in state.items() if keys(k)}


def _state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    extra: dict[str, Any] | None,
    namespace: str | None,
    keys: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """The DCP state of `save` and `load`: model (the entries in ``keys``), optimizers (under
    ``namespace``), then ``extra``."""
    state: dict[str, Any] = {"model": _model_state(model, keys)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=_OPTIM_OPTIONS)
    if namespace is not None:
        state = {namespace: state}
    return {**state, **(extra or {})}


def saved_entries(path: Path, prefix: str = "") -> dict[str, Any]:
    """DCP metadata of the entries saved under ``prefix`` (flattened dotted keys, prefix removed):
    what a checkpoint holds before anything is loaded."""
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key[len(prefix) :]: meta for key, meta in entries.items() if key.startswith(prefix)}


def load_model_weights(path: Path, model: nn.Module, keys: Callable[[str], bool] | None = None) -> None:
    """Loads only the model weights of a checkpoint (no process group needed); for generate/init_from.

    ``keys``: which entries (FQNs) to load (the others keep their values); None: all of them.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not is_checkpoint(path):
        raise CheckpointError(f"{path} is not a complete plait checkpoint (no .metadata or {META_FILE})")
    state = {"model": _model_state(model, keys)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=keys is None))
