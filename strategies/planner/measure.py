"""Measured per-rank bytes of one training step, to check the planner's memory model against.

`MemoryProbe` is a Lightning callback: during one optimizer step (by default the second: torch's
pipeline stages run an extra metadata-inference forward in their first step) it records, on every
rank,

- ``params``, ``grads``, ``optimizer``: bytes of the storages this rank holds for parameters,
  gradients (before the optimizer step) and optimizer state (after it). A DTensor counts its local
  tensor; storages shared by several tensors (FSDP2's flat reduce-scatter buffer of a block's
  gradients) count once.
- ``activations``: bytes of the tensors autograd saves for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``, per micro-batch forward this rank runs (the step's
  total over its micro-batches / their number). Storages count once, parameters (and FSDP's
  unsharded parameters) not at all. The probe keeps a reference to every saved tensor until the
  step ends, so a freed storage's address is never reused and counted twice.
- ``gathered``: bytes of the parameters FSDP2 holds gathered when the step's first backward
  starts (it registers a gathered parameter on its module as a plain tensor, a sharded one as a
  DTensor): the root's, and every block's that stays gathered from its forward to its backward.
  Plain tensors on a layout without tensor parallelism only (0 without FSDP).

Blocks under activation checkpointing save through the checkpoint's own hooks, which hide their
tensors from the probe; measure layouts without it.

Each rank writes ``memory_rank<r>.json`` into ``dirpath``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor -> its shard; a functional collective's AsyncCollectiveTensor -> the tensor it wraps.
    while isinstance(t, DTensor) or hasattr(t, "elem"):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``; a tensor without one counts its own bytes."""
    local = _local(t)
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(local), local.numel() * local.element_size()


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local tensor's)."""
    seen = dict(_storage_key(t) for t in tensors)
    seen.pop(0, None)  # empty storages
    return sum(seen.values())


class SavedTensorBytes:
    """Context manager summing the distinct storages autograd saves for backward (not parameters).

    Args:
        model: whose parameters (sharded or gathered, looked up at each save) are not counted.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._seen: set[int] = set()
        self._keep: list[torch.Tensor] = []
        self._hooks: Any = None

    def _param_ptrs(self) -> set[int]:
        return {_storage_key(p)[0] for p in self.model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if nbytes and ptr not in self._seen and ptr not in self._param_ptrs():
            self._seen.add(ptr)
            self.bytes += nbytes
            self._keep.append(t)  # its address stays taken until the step ends
        return t

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._keep.clear()


class MemoryProbe(L.Callback):
    """Writes this rank's measured bytes of one training step to ``dirpath/memory_rank<r>.json``.

    Args:
        dirpath: directory of the JSON files (the run directory when None).
        num_microbatches: micro-batch forwards each rank runs in the step (the activation bytes
            are divided by it).
        step: optimizer steps done before the measured one (1: the second step).
    """

    def __init__(self, dirpath: str | None = None, num_microbatches: int = 1, step: int = 1) -> None:
        self.dirpath, self.num_microbatches, self.step = dirpath, num_microbatches, step
        self._saved: SavedTensorBytes | None = None
        self._out: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self._saved = SavedTensorBytes(pl_module.model).__enter__()

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if self._saved is None or "gathered" in self._out:
            return
        params = list(pl_module.model.parameters())
        fsdp = any(isinstance(m, FSDPModule) for m in pl_module.model.modules())
        self._out["gathered"] = storage_bytes(p for p in params if not isinstance(p, DTensor)) if fsdp else 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self._saved is None:
            return
        self._saved.__exit__(None, None, None)
        params = list(pl_module.model.parameters())
        self._out |= {
            "params": storage_bytes(params),
            "grads": storage_bytes(p.grad for p in params if p.grad is not None),
            "activations": self._saved.bytes // self.num_microbatches,
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._saved is None:
            return
        self._saved = None
        opt = trainer.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        local_sgd = getattr(trainer.strategy, "plugins", {}).get("local_sgd")  # its anchors, outer state
        self._out["optimizer"] = storage_bytes([*state, *(local_sgd.kept_tensors() if local_sgd else [])])
        path = Path(self.dirpath or trainer.default_root_dir) / f"memory_rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self._out))


class StepTimer(L.Callback):
    """Writes rank 0's wall time of every training step (seconds) to ``dirpath/step_times.json``."""

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            path = Path(self.dirpath or trainer.default_root_dir) / "step_times.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.times))
