"""Heartbeats: a stalled rank is named while the others wait for it, and a lost rank after it died.

A collective waits for every rank of its group; a rank that is stopped (SIGSTOP, a debugger, a
swapping node), hung or dead leaves the others silent until the process-group timeout. Each rank
runs a daemon thread that bumps a counter under ``hb/<rank>`` in a small TCPStore of its own
(hosted by rank 0, found through one broadcast at start) every ``interval_s``, with the step it
is in, and reads the counters it watches: rank 0 watches every rank, the others watch rank 0
(the store's host: when it stops, their store calls block, which a second thread notices). A
counter that has not moved for ``stale_s`` (on the watcher's own monotonic clock, so the clocks of
different nodes never matter) is reported once, in one line naming the rank and its last step,
and again when it moves.

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
_STORE_ERRORS = (RuntimeError, ValueError)  # DistStoreError is a RuntimeError


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
        self._threads: list[threading.Thread] = []
        self._beats = 0
        # What the beat thread last read, per watched rank: (counter, step, monotonic time the counter moved).
        self._seen: dict[int, tuple[int, int, float]] = {}
        self._round = 0.0  # monotonic time the beat thread last finished a round with the store
        self._reported: set[int] = set()

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Every rank, once the default process group exists: rank 0 hosts the store, its port
        is broadcast, each rank starts its threads. A no-op on one rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Store calls wait as long as a stall may last: the watch thread reports meanwhile.
        timeout = timedelta(days=1)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self.rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        port = [self._store.port if self._store is not None else 0]
        dist.broadcast_object_list(port, src=0)
        if self.rank != 0:
            self._store = dist.TCPStore(host, port[0], is_master=False, timeout=timeout)
        self._round = time.monotonic()
        for target, name in ((self._beat_loop, "plait-heartbeat"), (self._watch_loop, "plait-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Ends the threads and leaves a tombstone (this rank ended on purpose: not lost); the
        store stays reachable for `lost_ranks`."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval_s)
        if self._threads:
            self._threads = []
            try:
                self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step} ended")  # type: ignore[union-attr]
            except _STORE_ERRORS:
                pass

    def set_step(self, step: int) -> None:
        """The optimizer step this rank is in (read by the threads; a plain int, no lock needed)."""
        self.step = step

    # ------------------------------------------------------------------------------ the threads
    def _watched(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def _read(self, rank: int) -> tuple[int, int, bool] | None:
        """(counter, step, ended) of ``rank``'s heartbeat, or None (not there, or the store is gone)."""
        store = self._store
        assert store is not None
        try:
            if not store.check([_KEY.format(rank)]):
                return None
            counter, step, *ended = store.get(_KEY.format(rank)).decode().split()
        except _STORE_ERRORS:
            return None
        return int(counter), int(step), bool(ended)

    def _beat_loop(self) -> None:
        assert self._store is not None
        while not self._stop.is_set():
            try:
                self._beats += 1
                self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step}")
            except _STORE_ERRORS:
                return  # the store's host is gone: lost_ranks names it after the collective fails
            now = time.monotonic()
            for rank in self._watched():
                value = self._read(rank)
                last = self._seen.get(rank)
                if value is not None and (last is None or value[0] != last[0] or value[2]):
                    self._seen[rank] = (value[0], value[1], now if not value[2] else float("inf"))
            self._round = now
            self._stop.wait(self.interval_s)

    def _stale(self, now: float) -> dict[int, tuple[float, int | None]]:
        """{rank: (seconds silent, its last step)} of the watched ranks silent for ``stale_s``."""
        stale = {}
        if self.rank != 0 and now - self._round >= self.stale_s:  # blocked on rank 0's store
            last = self._seen.get(0)
            stale[0] = (now - min(self._round, last[2] if last else self._round), last[1] if last else None)
        for rank in self._watched():
            last = self._seen.get(rank)
            if rank not in stale and last is not None and now - last[2] >= self.stale_s:
                stale[rank] = (now - last[2], last[1])
        return stale

    def _watch_loop(self) -> None:
        tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - tick > max(3 * self.interval_s, self.stale_s / 2):  # this process itself was stopped:
                self._round = now  # its view is old, not the peers' heartbeats
                self._seen = {r: (c, st, t if t == float("inf") else now) for r, (c, st, t) in self._seen.items()}
            tick = now
            stale = self._stale(now)
            for rank, (silent, step) in sorted(stale.items()):
                if rank not in self._reported:
                    self._reported.add(rank)
                    self.report(self._stall_line(rank, silent, step))
            for rank in sorted(self._reported - set(stale)):
                self._reported.discard(rank)
                self.report(f"plait: rank {rank} answers again (rank {self.rank} is at step {self.step})")

    def _stall_line(self, rank: int, silent: float, step: int | None) -> str:
        where = f"its last heartbeat was at step {step}" if step is not None else "it has sent no heartbeat"
        host = " (it hosts the heartbeat store)" if rank == 0 else ""
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
        if self.rank != 0 and self._read_within(0, 2 * self.interval_s) is None:
            return [0]  # rank 0's store is gone (or stopped: a read that does not come back in time)
        first = {rank: self._read(rank) for rank in range(self.world_size) if rank != self.rank}
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

    def _read_within(self, rank: int, seconds: float) -> tuple[int, int, bool] | None:
        """`_read` that gives up after ``seconds`` (the store calls themselves wait for a day)."""
        result: list[tuple[int, int, bool] | None] = [None]
        reader = threading.Thread(target=lambda: result.__setitem__(0, self._read(rank)), daemon=True)
        reader.start()
        reader.join(seconds)
        return result[0]

    def lost_line(self, lost: list[int]) -> str:
        """The one line a survivor prints after a collective failed because of ``lost``."""
        ranks = ", ".join(map(str, lost))
        return (
            f"plait: error: lost rank {ranks} at step {self.step} (its process ended without a word: killed, crashed "
            f"or its node failed); rank {self.rank} stops. Continue the run with resume=last"
        )
