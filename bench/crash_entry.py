"""``plait`` with a kill -9 planted at one point of the checkpoint path (for bench/crash_trials.py).

``PLAIT_CRASH_AT=<point>:<n>`` SIGKILLs the run's whole process group (every rank, as a lost
node would) the ``n``-th time rank 0 reaches ``<point>``:

- ``row``: the step's metrics row is written, its checkpoint not begun;
- ``files``: every rank wrote its DCP shards, RNG and meta files into ``step_*.tmp``, no manifest yet;
- ``background``: (``callbacks.checkpoint.async_save=true``) rank 0's background thread has written
  its shards and starts hashing them while training goes on; no manifest yet;
- ``rename``: the manifest is written, the ``.tmp`` directory not renamed;
- ``link``: the checkpoint is renamed, the ``last`` link not moved;
- ``prune``: an old checkpoint is renamed to ``.pruned-*``, not yet deleted.

Lightning's launcher re-runs this script for the other ranks; they install the same hooks, but
only rank 0 counts and kills.

Invocation: ``PLAIT_CRASH_AT=files:2 python bench/crash_entry.py <plait arguments>``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from strategies.checkpoint import async_save  # noqa: E402
from strategies.checkpoint import dcp as ckpt  # noqa: E402
from trainer.callbacks import checkpoint as callback  # noqa: E402
from trainer.loggers import RunCSVLogger  # noqa: E402

_seen: dict[str, int] = {}


def _reach(point: str) -> None:
    """Kills the process group at the configured occurrence of ``point``."""
    want, _, count = os.environ.get("PLAIT_CRASH_AT", "").partition(":")
    if want != point or any(os.environ.get(key, "0") != "0" for key in ("LOCAL_RANK", "NODE_RANK")):
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] == int(count or 1):
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _install() -> None:
    sync, write_manifest, hash_files, rmtree, symlink_to = (
        RunCSVLogger.sync,
        ckpt.write_manifest,
        async_save.hash_files,
        shutil.rmtree,
        pathlib.Path.symlink_to,
    )

    def on_sync(self, *args, **kwargs):  # noqa: ANN001, ANN202
        sync(self, *args, **kwargs)
        _reach("row")

    def on_manifest(root, files):  # noqa: ANN001, ANN202
        _reach("files")
        write_manifest(root, files)
        _reach("rename")

    def on_hash(root, names):  # noqa: ANN001, ANN202
        _reach("background")
        return hash_files(root, names)

    def on_rmtree(path, *args, **kwargs):  # noqa: ANN001, ANN202
        if pathlib.Path(path).name.startswith(".pruned-"):
            _reach("prune")
        return rmtree(path, *args, **kwargs)

    def on_symlink(self, target, *args, **kwargs):  # noqa: ANN001, ANN202
        if self.name == f".{callback.LAST}.tmp":
            _reach("link")
        return symlink_to(self, target, *args, **kwargs)

    RunCSVLogger.sync = on_sync
    ckpt.write_manifest = on_manifest
    async_save.hash_files = on_hash
    callback.shutil.rmtree = on_rmtree
    pathlib.Path.symlink_to = on_symlink


if __name__ == "__main__":
    _install()
    from trainer.cli import main

    main()
