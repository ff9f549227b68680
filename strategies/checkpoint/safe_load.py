"""Reading a checkpoint without running code from it: DCP metadata and pickled values, restricted.

A checkpoint directory may come from anywhere (a download, a shared drive). Python's pickle
calls whatever a file names, so every pickle plait reads goes through an allow-list:

- DCP's ``.metadata`` (which ``torch.distributed.checkpoint.FileSystemReader`` unpickles without
  restriction) is read by `read_dcp_metadata`: its unpickler resolves only the checkpoint metadata
  classes of ``torch.distributed.checkpoint`` and the torch types they hold (dtypes, sizes,
  layouts, paths). Anything else is refused before it is called.
- Non-tensor values inside DCP shards (optimizer param groups, counters), which DCP's default load
  planner reads with ``torch.load(weights_only=False)``, are read with ``weights_only=True`` by
  `SafeLoadPlanner`.
- ``meta.pt`` and ``rng/*.pt`` are read by `load_plain` (``torch.load(weights_only=True)``).

Source: the threat and the fix follow PyTorch's own ``weights_only`` unpickler
(torch/_weights_only_unpickler.py), which admits a fixed set of globals.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

METADATA_FILE = ".metadata"

# The classes DCP pickles into .metadata (torch 2.13: Metadata and its storage descriptors).
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name in torch's own namespace
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list (a tampered or foreign file)."""


class _MetadataUnpickler(pickle.Unpickler):
    @override
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafePickleError(f"refers to {module}.{name}, which checkpoint metadata never holds")


def read_dcp_metadata(path: str | os.PathLike, rank: int | None = None) -> dcp_metadata.Metadata:
    """DCP metadata of the checkpoint directory ``path``, unpickled through the allow-list.

    Args:
        rank: read the rank-local ``__<rank>.metadata`` of a no-process-group save; None: ``.metadata``.

    Raises:
        UnsafePickleError: the file names a global outside the allow-list; nothing it names ran.
        FileNotFoundError: there is no metadata file.
    """
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    with open(Path(path) / name, "rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafePickleError(f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader, with `read_metadata` through the allow-list."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(self.path, kwargs.get("rank"))
        if metadata.storage_meta is None:  # as FileSystemReader does: tag the load
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    @override
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafePickleError(f"the value of {read_item.dest_index.fqn!r} {err}") from None
        # Admitted by the restricted unpickler: the unrestricted one reaches only the same globals.
        super().load_bytes(read_item, io.BytesIO(data))


def load_dcp(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``dcp.load(state, checkpoint_id=path)`` through `SafeReader` and `SafeLoadPlanner`."""
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())


def load_plain(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain Python values only.

    Raises:
        UnsafePickleError: the file holds anything else; nothing it names ran.
    """
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafePickleError(refused(err)) from None


def refused(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused (its ``Unsupported global`` line): its message
    goes on to explain how to load unsafely, which plait never does."""
    if named := re.search(r"GLOBAL ([\w.]+)", str(err)):
        return f"names {named[1]}, which a weights-only load refuses"
    lines = [line.strip() for line in str(err).splitlines() if "Unsupported" in line]
    return lines[0] if lines else "holds values a weights-only load refuses"
