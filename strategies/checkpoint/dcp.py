"""Sharded, atomic, verified checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint is a directory::

    step_0000100/
      .metadata, __0_0.distcp, ...   # DCP: "model" and "optimizer_0" (resharded on load)
      meta.pt                        # Lightning's loop, scheduler, callback and data-loader state
      rng/rank_00000.pt ...          # per-rank Python, NumPy and torch RNG states
      manifest.json                  # every other file's size and SHA-256, written last

It is written to ``step_0000100.tmp`` and renamed once every rank has finished and the manifest
is written, so a crash during a save leaves the previous checkpoint intact and no directory that
looks complete; a save that fails to write (a full disk) removes its ``.tmp`` directory and says
which file, why, and how much space it needed (`strategies.checkpoint.write_failure`). Nothing is written
unless the whole state is finite (`strategies.checkpoint.finite`). A save given an `AsyncWriter` returns
once the state is copied and seals the checkpoint (manifest, rename) once its background write is
done (`strategies.checkpoint.async_save`). Loading trusts nothing on disk: the files must match the
manifest, pickles go through allow-lists (`strategies.checkpoint.safe_load`), and a state with NaN or inf is
refused.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from strategies.checkpoint.async_save import AsyncWriter
from strategies.checkpoint.finite import non_finite_entry, tensors
from strategies.checkpoint.manifest import MANIFEST, checkpoint_files, hash_files, verify, write_manifest
from strategies.checkpoint.plain_tensors import plain_state
from strategies.checkpoint.safe_load import UnsafePickleError, load_dcp, load_plain, read_dcp_metadata, refused
from strategies.checkpoint.write_failure import attempt_write, write_failure_line

META_FILE = "meta.pt"

# Flattened optimizer state is keyed by parameter FQN. Without it "param_groups" is one DCP key,
# deduplicated across ranks that hold different parameters (pipeline stages), and resuming fails.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the path and the fix."""


class NonFiniteStateError(CheckpointError):
    """The state to save, or a loaded state, holds NaN or inf."""


class CheckpointWriteError(CheckpointError):
    """A save could not write its files (a full disk, a quota, permissions); nothing of it is left."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (object all-gather on ``group``, None: the default; [value] without one)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _agree(problem: Any, group: Any = None) -> Any:
    """The first of all ranks' ``problem``s, so that every rank raises or none does."""
    return next((p for p in _gather(problem, group) if p is not None), None)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and this rank's CUDA device's) RNG states, in types a weights-only load reads.

    Only the current device's CUDA state is saved (each rank has its own file): the states of
    every visible GPU would not load where fewer are visible, and other ranks' devices are
    theirs to save."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores `rng_state`'s states; the CUDA one into the current device (on a machine without
    a GPU it is skipped). A list (checkpoints that saved every visible GPU) gives the current
    device's entry, or none when it has fewer entries."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        device = torch.cuda.current_device()
        cuda = cuda[device] if device < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a checkpoint directory whose save finished (it has a manifest).

    A quick test; `verify_checkpoint` also checks every file against the manifest.
    """
    return (Path(path) / MANIFEST).is_file()


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """Why ``path`` is not an intact checkpoint, or None when it is (see `strategies.checkpoint.manifest`)."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    return verify(path, checksums=checksums)


def _check_plain(meta: dict[str, Any]) -> str | None:
    """Why ``meta`` would not load with ``weights_only=True`` (a type a safe load refuses), or None."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        return lines[0] if lines else "a value a weights-only load refuses"
    return None


def save(
    path: Path,
    *,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    meta: dict[str, Any],
    extra: dict[str, Any] | None = None,
    namespace: str | None = None,
    keys: Callable[[str], bool] | None = None,
    writer: AsyncWriter | None = None,
) -> None:
    """Collectively and atomically writes a verified checkpoint of ``model`` and ``optimizers``.

    Every rank calls it. ``meta`` (loop and scheduler state) is written by rank 0. Each rank
    hashes its share of the files; rank 0 writes ``manifest.json`` last and renames the directory.

    Args:
        extra: more DCP state by top-level key (a strategy plugin's tensors and counters).
        namespace: the key this rank's "model" and "optimizer_i" go under; None: the top level.
            Ranks whose model state differs from rank 0's (local-SGD islands) keep their own.
        keys: which model state entries (FQNs) to write; None: all (LoRA: only the adapters).
        writer: write in the background (`strategies.checkpoint.async_save`): the save it holds
            is finished first; this one returns once the state is copied (``meta.pt`` and the RNG
            states are written now), and the checkpoint is complete after ``writer.finish()``.

    Raises:
        NonFiniteStateError: some rank's state holds NaN or inf; nothing was written.
        TypeError: ``meta`` holds a value a weights-only load cannot read; nothing was written.
        CheckpointWriteError: a file could not be written (ENOSPC: the disk is full); the
            ``.tmp`` directory is removed, the checkpoints already written are kept. With a
            ``writer``, a failed background write raises from ``writer.finish()``.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if writer is not None:
        writer.finish()  # at most one save in flight
    # Plain tensors in what the plugins add too (DiLoCo's anchors clone float8-cast weights); only when saving:
    # a load fills ``extra`` in place, and its non-tensor values are replaced in the dict given.
    state = _state(model, optimizers, plain_state(extra) if extra else extra, namespace, keys)
    if problem := _agree(_check_plain(meta)):
        raise TypeError(f"checkpoint meta (loop and callback state) would not load safely: {problem}")
    bad = _gather(non_finite_entry(state))
    if any(key is not None for key in bad):
        rank = next(r for r, key in enumerate(bad) if key is not None)
        raise NonFiniteStateError(
            f"not saving {path.name}: the model or optimizer state holds NaN or inf ({bad[rank]} on rank {rank}); "
            f"the checkpoints already written are kept"
        )
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a crash during an earlier save
    _barrier()
    needed = _num_bytes(state)
    if writer is None:
        failed = _agree(attempt_write(_write_files, tmp, state, meta))  # every rank has written (or failed) now
        share = None if failed is not None else hash_files(tmp, checkpoint_files(tmp)[_rank() :: _world_size()])
        _commit(path, tmp, needed, failed, share)
        return
    failed = _agree(attempt_write(_write_small_files, tmp, meta))
    if failed is not None:
        _commit(path, tmp, needed, failed, None)
    writer.start(path, tmp, state, functools.partial(_commit, path, tmp, needed))


def _commit(
    path: Path,
    tmp: Path,
    needed: int,
    failed: OSError | None,
    share: dict[str, dict[str, int | str]] | None,
    group: Any = None,
) -> None:
    """Seals the written ``tmp`` as ``path`` (every rank, collective on ``group``): rank 0 writes the
    manifest from every rank's ``share`` of it and renames; after a failed write (``failed`` on some
    rank) removes ``tmp`` and raises CheckpointWriteError naming the file and the space needed."""
    failed = _agree(failed, group)
    if failed is None:
        shares = _gather(share, group)
        entries = {name: entry for share in shares for name, entry in share.items()}
        failed = _agree(attempt_write(write_manifest, tmp, entries) if _rank() == 0 else None, group)
    if failed is not None:
        total = sum(_gather(needed, group))
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(group)
        raise CheckpointWriteError(write_failure_line(path, failed, total))
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    _barrier(group)


def _write_files(tmp: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """This rank's files of a save into ``tmp``: its DCP shards (collective), its RNG state, and
    on rank 0 ``meta.pt``. No barrier at the end: a rank that failed must reach `_agree` too."""
    dcp.save(state, checkpoint_id=tmp)
    _write_small_files(tmp, meta)


def _write_small_files(tmp: Path, meta: dict[str, Any]) -> None:
    """This rank's RNG state and, on rank 0, ``meta.pt`` into ``tmp``: the state of the moment of the save."""
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        torch.save(meta, tmp / META_FILE)


def _num_bytes(state: dict[str, Any]) -> int:
    """About the bytes this rank's part of ``state`` takes on disk (its tensors; 8 per float)."""
    return sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 8 for _, v in tensors(state))


def seal(path: Path) -> None:
    """Writes the manifest of a checkpoint directory one process wrote itself (a merge's output)."""
    path = Path(path)
    write_manifest(path, hash_files(path, checkpoint_files(path)))


def _fsync_dir(directory: Path) -> None:
    """Makes a rename in ``directory`` durable (POSIX: fsync the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """`load_dcp`, with its failures (on any rank) as one CheckpointError on every rank."""
    try:
        read_dcp_metadata(path)  # DCP would retry another metadata file and hide the refusal
        load_dcp(state, path)
    except (CheckpointException, Exception) as err:  # DCP's CheckpointException is a BaseException
        causes = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        causes = [UnsafePickleError(refused(c)) if type(c) is pickle.UnpicklingError else c for c in causes]
        unsafe = next((c for c in causes if isinstance(c, UnsafePickleError)), None)
        if unsafe is not None:
            raise CheckpointError(
                f"{path}: the DCP metadata or a saved value {unsafe}; plait refused to unpickle it (the checkpoint "
                f"may have been tampered with); use another checkpoint or a trusted copy"
            ) from None
        cause = causes[0] if causes else err
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise CheckpointError(
            f"{path} could not be loaded ({type(cause).__name__}: {first}); it is damaged or was written for "
            f"another model: use another checkpoint"
        ) from None


def _load_plain(path: Path, what: str) -> tuple[Any, str | None]:
    """(value, None) of a weights-only file, or (None, why it refused)."""
    try:
        return load_plain(path), None
    except UnsafePickleError as err:
        return None, f"{path}: {err}; plait refused to unpickle {what} (the checkpoint may have been tampered with)"
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        return None, f"{path}: {what} is unreadable ({type(err).__name__}); the checkpoint is damaged"


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
    as in `save` (the model entries outside ``keys`` keep their values); DCP loads ``extra`` in
    place (tensors are filled, other values replaced). File names and sizes are checked against
    the manifest here; the caller chose ``path`` after a full `verify_checkpoint` (checksums).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, a file refuses a safe load, or
            the loaded state holds NaN or inf (`NonFiniteStateError`); raised on every rank.
    """
    path = Path(path)
    if reason := verify_checkpoint(path, checksums=False):
        raise CheckpointError(
            f"{path} is not a complete plait checkpoint ({reason}); "
            f"point resume= at a step_* directory or a run directory with checkpoints"
        )
    state = _state(model, optimizers, extra, namespace, keys)
    _dcp_load(state, path)
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if not rng_file.exists():
        rng_file = path / "rng" / "rank_00000.pt"
    rng, rng_problem = _load_plain(rng_file, "the RNG state")
    meta, meta_problem = _load_plain(path / META_FILE, "the loop state")
    if problem := _agree(rng_problem or meta_problem):
        raise CheckpointError(problem)
    if bad := _agree(non_finite_entry(state)):
        raise NonFiniteStateError(f"{path} holds NaN or inf ({bad}); resume from an earlier checkpoint")
    if namespace is not None:
        state = state[namespace]
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=keys is None))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_OPTIM_OPTIONS)
    set_rng_state(rng)
    return meta


def _model_state(model: nn.Module, keys: Callable[[str], bool] | None) -> dict[str, Any]:
    state = plain_state(get_model_state_dict(model))  # float8 all-gather weights as their own tensors
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
        state[f"optimizer_{i}"] = plain_state(get_optimizer_state_dict(model, opt, options=_OPTIM_OPTIONS))
    if namespace is not None:
        state = {namespace: state}
    return {**state, **(extra or {})}


def saved_entries(path: Path, prefix: str = "") -> dict[str, Any]:
    """DCP metadata of the entries saved under ``prefix`` (flattened dotted keys, prefix removed):
    what a checkpoint holds before anything is loaded.

    Raises:
        CheckpointError: the metadata refuses a safe load.
    """
    try:
        entries = read_dcp_metadata(path).state_dict_metadata
    except UnsafePickleError as err:
        raise CheckpointError(f"{path}/.metadata {err}; plait refused to unpickle it") from None
    return {key[len(prefix) :]: meta for key, meta in entries.items() if key.startswith(prefix)}


def load_model_weights(path: Path, model: nn.Module, keys: Callable[[str], bool] | None = None) -> None:
    """Loads only the model weights of a checkpoint (no process group needed); for generate/init_from.

    ``keys``: which entries (FQNs) to load (the others keep their values); None: all of them.

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, refuses a safe load, or holds
            NaN or inf.
    """
    path = Path(path)
    if reason := verify_checkpoint(path, checksums=False):
        raise CheckpointError(f"{path} is not a complete plait checkpoint ({reason})")
    state = {"model": _model_state(model, keys)}
    _dcp_load(state, path)
    if bad := _agree(non_finite_entry(state)):
        raise NonFiniteStateError(f"{path} holds NaN or inf ({bad}); use an earlier checkpoint")
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=keys is None))
