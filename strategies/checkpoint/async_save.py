"""Asynchronous checkpoint saves: training waits for a staging copy, the write overlaps the next steps.

A synchronous save (`strategies.checkpoint.dcp.save`) blocks training for the whole write. With an
`AsyncWriter`, the save copies this rank's model and optimizer state into host memory it keeps for
the next save (DCP's ``DefaultStager``; pinned on a GPU machine) and hands the copy to DCP's
``async_save``, which plans and writes it in a thread on a gloo process group of its own, so its
collectives never interleave with training's. The same thread then hashes this rank's share of the
checkpoint's files for the manifest.

A checkpoint is still complete only when its manifest is written last and its ``.tmp`` directory
renamed: `AsyncWriter.finish` does that, on every rank, once every rank's write is done: the trainer
calls it at a step boundary after `all_written` agrees that it is, before the next save (at most
one save is in flight), and at the end of training. A kill during the background write leaves the
``.tmp`` directory without a manifest: the previous checkpoint stays the newest complete one.

After torchtitan's ``checkpoint.async_mode`` (``torchtitan/components/checkpoint.py``: its own
gloo group for ``dcp.async_save``, a wait on the previous future before the next save).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from strategies.checkpoint.manifest import checkpoint_files, hash_files
from strategies.checkpoint.write_failure import attempt_write

# (this rank's write error or None, this rank's share of the manifest entries or None)
Written = tuple[OSError | None, dict[str, dict[str, int | str]] | None]
# Seals a written checkpoint on every rank: (written, the writer's group) -> None; raises on a failed write.
Commit = Callable[[OSError | None, dict[str, dict[str, int | str]] | None, Any], None]


class AsyncWriter:
    """At most one checkpoint save in flight; `strategies.checkpoint.dcp.save` starts it, `finish` seals it.

    Every rank holds one and calls its methods at the same points (they are collective).

    Its gloo groups keep torch's default timeout (30 minutes): the write's last collective waits
    for the slowest rank's files, which may take longer than a training collective's timeout.
    """

    def __init__(self) -> None:
        self.path: Path | None = None  # the checkpoint being written (its final name)
        self._written: Future[Written] | None = None
        self._commit: Commit | None = None
        self._write_group: Any = None
        self._poll_group: Any = None
        self._poll_flag = torch.zeros(1)
        self._poll_work: Any = None
        self._world = 1
        # Keeps its host copy of the state between saves (no allocation per save). Synchronous staging:
        # the save returns only once the copy is taken, so the next step may change the live state.
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-ckpt-hash")

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet finished."""
        return self._written is not None

    def _groups(self) -> None:
        """Creates the writer's gloo groups once (collective: every rank, at its first save)."""
        if self._write_group is not None or not _distributed():
            return
        self._world = dist.get_world_size()
        # Also on one rank: DCP's async save needs a CPU group (a GPU run's default one is NCCL). Two groups:
        # the background write's collectives run in DCP's thread while the main thread asks
        # whether it is done; one group for both would interleave them.
        self._write_group = dist.new_group(backend="gloo")
        self._poll_group = dist.new_group(backend="gloo")

    def start(self, path: Path, tmp: Path, state: dict[str, Any], commit: Commit) -> None:
        """Stages ``state`` (blocking) and writes it into ``tmp`` in the background; finishes a
        pending save first. ``commit`` seals the checkpoint once every rank's write is done."""
        self.finish()
        self._groups()
        rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        upload = dcp.async_save(
            state, checkpoint_id=tmp, process_group=self._write_group, async_stager=self._stager, no_dist=world == 1
        )

        def written() -> Written:
            try:
                failed = attempt_write(upload.result)
            except BaseException as err:  # noqa: BLE001  (DCP's CheckpointException): every rank must agree
                first = str(err).splitlines()[0] if str(err) else ""
                failed = OSError(errno.EIO, f"the background write failed ({type(err).__name__}: {first})")
            if failed is not None:
                return failed, None
            # DCP's last collective (rank 0 writes .metadata) is done: every rank's files are there.
            try:
                names = checkpoint_files(tmp)
                return None, hash_files(tmp, names[rank::world])
            except OSError as err:  # a file that cannot be read back: this rank's failure, agreed at the seal
                return err, None

        self.path, self._commit = path, commit
        self._written = self._hasher.submit(written)

    def begin_poll(self) -> None:
        """Starts the agreement on whether every rank's write is done (call at a step's start)."""
        if self._written is None or self._world == 1:
            return
        self._poll_flag.fill_(float(self._written.done()))
        self._poll_work = dist.all_reduce(self._poll_flag, op=dist.ReduceOp.MIN, group=self._poll_group, async_op=True)

    def all_written(self) -> bool:
        """Whether every rank's write was done when `begin_poll` ran (call at the same step's end)."""
        if self._written is None:
            return False
        if self._world == 1:
            return self._written.done()
        if self._poll_work is None:
            return False
        self._poll_work.wait()
        self._poll_work = None
        return bool(self._poll_flag.item())

    def finish(self) -> Path | None:
        """Waits for the pending write and seals it (every rank); returns its path, None when none was pending.

        Raises:
            CheckpointWriteError: some rank's write failed (from the commit); its ``.tmp`` is removed.
        """
        if self._written is None:
            return None
        if self._poll_work is not None:  # a poll begun this step: complete it so the group stays in step
            self._poll_work.wait()
            self._poll_work = None
        failed, share = self._written.result()
        path, commit = self.path, self._commit
        self._written, self.path, self._commit = None, None, None
        assert commit is not None
        commit(failed, share, self._write_group)
        return path

    def finish_after_error(self, wait_s: float = 60.0) -> Path | None:
        """`finish` on the way out of a failed run, when the other ranks may not be here: seals the
        pending save only if every rank reaches it within ``wait_s`` seconds; None otherwise (its
        ``.tmp`` stays without a manifest, the previous checkpoint is the newest complete one)."""
        if self._written is None:
            return None
        if self._write_group is not None:
            try:  # this rank's part (its write waits on the other ranks' too), then the others, each bounded
                self._written.result(timeout=wait_s)
                dist.monitored_barrier(group=self._write_group, timeout=timedelta(seconds=wait_s))
            except (RuntimeError, FuturesTimeout):
                self._written, self.path, self._commit = None, None, None
                return None
        return self.finish()

    def close(self) -> None:
        """Releases the host copy and the thread; a save still pending (abandoned after an error) is not
        waited for (its thread ends with its write, or with the group's timeout when a rank is gone)."""
        self._stager.close()
        self._hasher.shutdown(wait=False, cancel_futures=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
