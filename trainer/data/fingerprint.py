"""What a run's data is, as one hash: a resume refuses data that changed under the same config.

A checkpoint's saved data position (global batches trained, `trainer.data.loader`) indexes the
rows the run was prepared with. The config names files, not their contents, so a file rewritten
at the same path (documents added, removed or reordered) resumed silently on other rows, and
documents held out before could be trained on. `prepared_fingerprint` hashes the prepared data
itself (token ids, labels, positions, document ids, held-out prompts and answers) and
`trainer.resume` compares it with the one the checkpoint recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Container, Mapping
from typing import Any

import numpy as np
import torch


def prepared_fingerprint(prepared: Any, *, skip: Container[str] = ()) -> str:
    """16 hex characters of sha256 over the prepared data ``prepared`` (a data module's
    `trainer.data.base.DataModule.prepare`): its tensors and arrays by dtype, shape and bytes,
    its strings and numbers by value, walked through dataclasses, objects, mappings and
    sequences in a fixed order.

    Args:
        prepared: the prepared data.
        skip: field names left out at any depth (the tokenizer, compared by its own fingerprint;
            tables filled later in the run, such as reference log-probs).
    """
    digest = hashlib.sha256()
    _update(digest, prepared, skip)
    return digest.hexdigest()[:16]


def _update(digest: Any, value: Any, skip: Container[str]) -> None:
    if isinstance(value, torch.Tensor):
        shape = value.shape
        value = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(shape)}".encode())
        digest.update(value.view(torch.uint8).numpy() if value.numel() else b"")
    elif isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value)
        digest.update(f"A{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    elif value is None or isinstance(value, str | int | float | bool):
        digest.update(json.dumps(value).encode() + b"\x00")
    elif isinstance(value, Mapping):
        digest.update(f"M{len(value)}".encode())
        for key in sorted(value, key=str):
            if str(key) not in skip:
                digest.update(str(key).encode() + b"\x00")
                _update(digest, value[key], skip)
    elif isinstance(value, list | tuple):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _update(digest, item, skip)
    elif dataclasses.is_dataclass(value):
        _update(digest, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, skip)
    elif hasattr(value, "__dict__"):
        _update(digest, vars(value), skip)
    else:
        raise TypeError(f"prepared_fingerprint cannot hash a {type(value).__name__}")
