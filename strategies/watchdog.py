"""Heartbeats: a stalled rank is named while the others wait for it, and a lost rank after it died.

A collective waits for every rank of its group; a rank that is stopped (SIGSTOP, a debugger, a
swapping node), hung or dead leaves the others silent until the process-group timeout. Each rank
runs a daemon thread that bumps a counter under ``hb/<rank>`` in a small TCPStore of its own
(hosted by rank 0, found through one broadcast at start) every ``interval_s``, with the step it
is in. Rank 0 watches every rank; the others watch rank 0 (the store's host; if it stops, their
store calls time out). A counter that has not moved for ``stale_s`` (measured on the watcher's
own monotonic clock, so clocks of different nodes never matter) is reported once, in one line
naming the rank and its last step, and again when it moves.

After a collective failed (a peer died: gloo reports a closed connection), `Heartbeat.lost_ranks`
waits up to ``2 x interval_s`` and returns the ranks whose counter stopped: the run prints one
line naming them instead of a backend traceback.

torchelastic and NCCL's watchdog detect hangs too, but name neither the stalled rank nor the step,
and only at the timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_KEY = "hb/{}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Heartbeat:
    """Publishes this rank's heartbeat and reports stalled peers (see the module docstring).

    Args:
        stale_s: seconds without a heartbeat before a rank is reported (> ``interval_s``).
        interval_s: seconds between heartbeats.
        report: where report lines go (stderr).
    """

    def __init__(self, *, stale_s: float = 60.0, interval_s: float = 5.0, report: Callable[[str], None] = _stderr) -> None:
        if not 0 < interval_s < stale_s:
            raise ValueError(f"heartbeat interval_s={interval_s} must be > 0 and below stale_s={stale_s}")
        self.stale_s, self.interval_s, self.report = stale_s, interval_s, report
        self.step = 0
        self.rank, self.world_size = 0, 1
        self._store: dist.Store | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, monotonic time it last changed)
        self._steps: dict[int, int] = {}  # rank -> its step at its last heartbeat
        self._reported: set[int] = set()

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Every rank, once the default process group exists: rank 0 hosts the store, its port
        is broadcast, each rank starts its thread. A no-op on one rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        timeout = timedelta(seconds=max(self.interval_s, 5.0))
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self.rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        port = [self._store.port if self._store is not None else 0]
        dist.broadcast_object_list(port, src=0)
        if self.rank != 0:
            self._store = dist.TCPStore(host, port[0], is_master=False, timeout=timeout)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="plait-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread and leaves a tombstone (this rank ended on purpose, it is not lost); the
        store stays reachable for `lost_ranks`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None
            try:
                self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step} ended")  # type: ignore[union-attr]
            except (RuntimeError, dist.DistError):
                pass

    def set_step(self, step: int) -> None:
        """The optimizer step this rank is in (read by the thread; a plain int, no lock needed)."""
        self.step = step

    # ------------------------------------------------------------------------------ the thread
    def _beat(self) -> None:
        assert self._store is not None
        self._beats += 1
        self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step}")

    def _watched(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def _read(self, rank: int) -> tuple[int, int, bool] | None:
        """(counter, step, ended) of ``rank``'s heartbeat, or None when the store does not answer."""
        assert self._store is not None
        try:
            counter, step, *ended = self._store.get(_KEY.format(rank)).decode().split()
        except (RuntimeError, ValueError, dist.DistError):  # a store timeout or a peer not started
            return None
        return int(counter), int(step), bool(ended)

    def _check(self, now: float) -> list[tuple[int, float, int | None]]:
        """(rank, seconds since its counter moved, its step) of every watched rank that is stale."""
        stale = []
        for rank in self._watched():
            value = self._read(rank)
            last = self._seen.get(rank)
            if value is not None and value[2]:
                continue  # it ended on purpose
            if last is None or (value is not None and value[0] != last[0]):
                self._seen[rank] = (value[0] if value is not None else -1, now)
                if value is not None:
                    self._steps[rank] = value[1]
                continue
            if now - last[1] >= self.stale_s:
                stale.append((rank, now - last[1], self._steps.get(rank)))
        return stale

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except (RuntimeError, dist.DistError):
                pass  # rank 0's store does not answer: _check reports rank 0
            now = time.monotonic()
            stale = self._check(now)
            for rank, silent, step in stale:
                if rank not in self._reported:
                    self._reported.add(rank)
                    self.report(self._stall_line(rank, silent, step))
            for rank in sorted(self._reported - {r for r, _, _ in stale}):
                self._reported.discard(rank)
                self.report(f"plait: rank {rank} answers again (this rank {self.rank} is at step {self.step})")

    def _stall_line(self, rank: int, silent: float, step: int | None) -> str:
        where = f"its last heartbeat was at step {step}" if step is not None else "it has sent no heartbeat"
        host = " (rank 0 hosts the heartbeat store)" if rank == 0 else ""
        return (
            f"plait: rank {rank}{host} has not answered for {silent:.0f} s ({where}); rank {self.rank} is at step "
            f"{self.step}, waiting for it: is that process stopped or hung? The run aborts at strategy.timeout_s"
        )

    # ------------------------------------------------------------------------------ after a failure
    def lost_ranks(self) -> list[int]:
        """Ranks whose heartbeat stopped without a tombstone, watched for up to ``2 x interval_s``
        (after a collective failed); [0] when the store itself is gone (rank 0 lost)."""
        if self._store is None:
            return []
        first = {rank: self._read(rank) for rank in range(self.world_size) if rank != self.rank}
        if self.rank != 0 and first[0] is None:
            return [0]
        alive = {rank for rank, value in first.items() if value is not None and value[2]}
        deadline = time.monotonic() + 2 * self.interval_s
        # Rank 0 stays the whole window: the others read its store meanwhile.
        while time.monotonic() < deadline and (self.rank == 0 or len(alive) < len(first)):
            time.sleep(self.interval_s / 4)
            for rank, value in first.items():
                now = self._read(rank)
                if now is not None and (now[2] or value is None or now[0] != value[0]):
                    alive.add(rank)
        return sorted(set(first) - alive)

    def lost_line(self, lost: list[int]) -> str:
        """The one line a survivor prints after a collective failed because of ``lost``."""
        ranks = ", ".join(map(str, lost))
        return (
            f"plait: error: lost rank {ranks} at step {self.step} (its process ended without a word: killed, crashed "
            f"or its node failed); rank {self.rank} stops. Continue the run with resume=last"
        )
