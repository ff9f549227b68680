"""A save that hits a full disk raises one line (the file, ENOSPC, the space needed), leaves no
``.tmp`` directory, and keeps the checkpoints already written.

The full disk is simulated where each file of a save is written: DCP's file streams (its shards
and ``.metadata``) raise ``OSError(ENOSPC)`` once a byte budget is spent, as a real disk does in
the middle of a file; ``meta.pt`` and ``manifest.json`` raise it when they are written.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.dcp import META_FILE
from strategies.checkpoint.manifest import MANIFEST


def _disk_full(filename: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))


class _FillingStream:
    """A file stream on a disk with ``room`` bytes left: a write past them raises ENOSPC."""

    def __init__(self, stream: Any, path: object, room: list[int]) -> None:
        self.stream, self.path, self.room = stream, path, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room[0]:
            self.stream.write(bytes(data)[: self.room[0]])
            self.room[0] = 0
            raise _disk_full(self.path)
        self.room[0] -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def _full_dcp_disk(monkeypatch: pytest.MonkeyPatch, room: int) -> Iterator[None]:
    real = FileSystem.create_stream
    left = [room]

    @contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with real(self, path, mode) as stream:
            yield _FillingStream(stream, path, left) if "w" in mode else stream

    with monkeypatch.context() as patch:
        patch.setattr(FileSystem, "create_stream", create_stream)
        yield


@contextmanager
def _full_at(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """``torch.save`` of ``name`` (meta.pt) or the manifest's write raise ENOSPC."""
    with monkeypatch.context() as patch:
        if name == MANIFEST:

            def write_manifest(directory: Path, entries: dict) -> None:
                raise _disk_full(Path(directory) / MANIFEST)

            patch.setattr(ckpt, "write_manifest", write_manifest)
        else:
            real = torch.save

            def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
                if isinstance(f, (str, os.PathLike)) and Path(f).name == name:
                    Path(f).write_bytes(b"\0" * 10)  # what the disk took before it filled
                    raise _disk_full(f)
                real(obj, f, *args, **kwargs)

            patch.setattr(torch, "save", save)
        yield


def _save(path: Path, step: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    ckpt.save(path, model=model, optimizers=[optimizer], meta={"global_step": step})


@pytest.mark.parametrize("where", ["dcp shard", META_FILE, MANIFEST])
def test_a_full_disk_says_one_line_and_keeps_the_earlier_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    _save(tmp_path / "step_0000001", 1)
    full = _full_dcp_disk(monkeypatch, room=5000) if where == "dcp shard" else _full_at(monkeypatch, where)
    with full, pytest.raises(ckpt.CheckpointWriteError) as raised:
        _save(tmp_path / "step_0000002", 2)
    message = str(raised.value)
    assert "\n" not in message and "not saving step_0000002: No space left on device (ENOSPC) writing" in message
    assert str(tmp_path / "step_0000002.tmp") in message  # the file that failed lies in it
    assert "the checkpoint needs about 0.0" in message and "MiB are free in" in message  # 4.2k params, ~50 KiB
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001"]  # no .tmp, no step 2
    assert ckpt.verify_checkpoint(tmp_path / "step_0000001") is None
    _save(tmp_path / "step_0000002", 2)  # space freed: the next save works
    assert ckpt.verify_checkpoint(tmp_path / "step_0000002") is None


def test_another_write_error_names_its_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.save

    def denied(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)):  # a file, not check_plain's buffer
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(f))
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", denied)
    with pytest.raises(
        ckpt.CheckpointWriteError, match=r"Permission denied \(EACCES\) writing .*rank_00000\.pt"
    ) as raised:
        _save(tmp_path / "step_0000001", 1)
    assert "needs about" not in str(raised.value) and not any(tmp_path.iterdir())
