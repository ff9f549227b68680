"""Heartbeats: a stalled rank is named while the others wait for it, and a lost rank after it died.

A collective waits for every rank of its group; a rank that is stopped (SIGSTOP, a debugger, a
swapping node), hung or dead leaves the others silent until the process-group timeout. Each rank
runs a daemon thread that bumps a counter under ``hb/<rank>`` in a small TCPStore of its own
(hosted by rank 0, found through one broadcast at start) every ``interval_s``, with the step it
is in, and reads the counters it watches: rank 0 watches every rank, the others watch rank 0
(the store's host: when it stops, their store calls block, which a second thread notices). A
counter that has not moved for ``stale_s`` (on the watcher's own monotonic clock, so the clocks of
different nodes never matter) is reported once, in one line naming the rank and its last step,
and again when it moves. A rank publishes at once when it enters a new step (not only every
``interval_s``), so the step a report names is the one the silent rank stopped in (for rank 0,
whose stopped store answers no reads, the one it had published when the reader last read: its
step, or the one before if it stopped within moments of starting a step).

A counter silent for ``abort_s`` (``strategy.timeout_s``) ends the watcher's process: one
``plait: error:`` line naming the rank and its step, then exit `ABORT_EXIT` (the code of a lost
rank). The backend's own timeout is not relied on: a rank blocked in a store call or a collective
on a stopped peer may never see it. The other ranks then see this one gone and end through
`lost_ranks`; a stopped rank that is continued later finds its peers gone and ends the same way.

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
from typing import Any

import torch.distributed as dist

_KEY = "hb/{}"
ABORT_EXIT = 4  # a rank lost or silent past strategy.timeout_s: the run ends, resume=last continues it
_STORE_ERRORS = (RuntimeError, ValueError)  # DistStoreError is a RuntimeError


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _within(call: Callable[[], Any], seconds: float) -> Any:
    """``call()``'s result, or None when it has not returned after ``seconds`` (it goes on in a
    daemon thread) or raised a store error."""
    result: list[Any] = [None]

    def run() -> None:
        try:
            result[0] = call()
        except _STORE_ERRORS:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0]


class Heartbeat:
    """Publishes this rank's heartbeat and reports stalled peers (see the module docstring).

    Args:
        stale_s: seconds without a heartbeat before a rank is reported (> ``interval_s``).
        interval_s: seconds between heartbeats.
        abort_s: seconds without a heartbeat after which this process ends the run (> ``stale_s``);
            None: never (the backend's timeout only).
        report: where report lines go (stderr).
        abort: ends this process with an exit code (``os._exit``: the main thread may be blocked
            in a collective that never returns).

    Raises:
        ValueError: ``interval_s``, ``stale_s`` and ``abort_s`` not increasing.
    """

    def __init__(
        self,
        *,
        stale_s: float = 60.0,
        interval_s: float = 5.0,
        abort_s: float | None = None,
        report: Callable[[str], None] = _stderr,
        abort: Callable[[int], None] = os._exit,
    ) -> None:
        if not 0 < interval_s < stale_s:
            raise ValueError(f"heartbeat interval_s={interval_s} must be > 0 and below stale_s={stale_s}")
        if abort_s is not None and abort_s <= stale_s:
            raise ValueError(f"heartbeat abort_s={abort_s} must be above stale_s={stale_s}")
        self.stale_s, self.interval_s, self.abort_s, self.report, self.abort = (
            stale_s,
            interval_s,
            abort_s,
            report,
            abort,
        )
        self.step = 0
        self._moved = threading.Event()  # set_step was called: publish at once
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
        self._moved.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval_s)
        if self._threads:
            self._threads = []
            # Bounded: a stopped store host would block the write (and this rank's exit) for a day.
            _within(
                lambda: self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step} ended"), 2 * self.interval_s
            )  # type: ignore[union-attr]

    def set_step(self, step: int) -> None:
        """The optimizer step this rank is in (read by the threads; a plain int, no lock needed);
        the beat thread publishes it at once."""
        self.step = step
        self._moved.set()

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
        """Publishes this rank's counter and step every ``interval_s`` and at each new step.
        Rank 0 reads the others' every ``interval_s`` (a stopped rank's last value stays in the
        store for its next read); the others read rank 0's at each beat (once rank 0 is stopped,
        its store answers no more reads)."""
        assert self._store is not None
        read_at = 0.0
        while not self._stop.is_set():
            self._moved.clear()
            try:
                self._beats += 1
                self._store.set(_KEY.format(self.rank), f"{self._beats} {self.step}")
            except _STORE_ERRORS:
                return  # the store's host is gone: lost_ranks names it after the collective fails
            now = time.monotonic()
            if self.rank != 0 or now - read_at >= self.interval_s:
                for rank in self._watched():
                    value = self._read(rank)
                    last = self._seen.get(rank)
                    if value is not None and (last is None or value[0] != last[0] or value[2]):
                        self._seen[rank] = (value[0], value[1], now if not value[2] else float("inf"))
                read_at = self._round = now
            self._moved.wait(max(0.0, self.interval_s - (time.monotonic() - read_at)))

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
            late = {r: v for r, v in stale.items() if self.abort_s is not None and v[0] >= self.abort_s}
            if late:
                rank, (silent, step) = min(late.items())
                self.report(self._abort_line(rank, silent, step))
                self.abort(ABORT_EXIT)
                return

    def _stall_line(self, rank: int, silent: float, step: int | None) -> str:
        where = f"its last heartbeat was at step {step}" if step is not None else "it has sent no heartbeat"
        host = " (it hosts the heartbeat store)" if rank == 0 else ""
        return (
            f"plait: rank {rank}{host} has not answered for {silent:.0f} s ({where}); rank {self.rank} is at step "
            f"{self.step}, waiting for it: is that process stopped or hung? The run aborts at strategy.timeout_s"
        )

    def _abort_line(self, rank: int, silent: float, step: int | None) -> str:
        where = f"in step {step}" if step is not None else "before its first heartbeat"
        return (
            f"plait: error: rank {rank} has not answered for {silent:.0f} s ({where}), past strategy.timeout_s={self.abort_s:g}; "
            f"rank {self.rank} ends the run (exit {ABORT_EXIT}). If that process is stopped or hung, end it; continue the "
            "run with resume=last"
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
        return _within(lambda: self._read(rank), seconds)

    def lost_line(self, lost: list[int]) -> str:
        """The one line a survivor prints after a collective failed because of ``lost``."""
        ranks = ", ".join(map(str, lost))
        why = (
            "it stopped answering and the collective timed out: stopped or hung"
            if set(lost) <= self._reported
            else "its process ended without a word: killed, crashed or its node failed"
        )
        return f"plait: error: lost rank {ranks} at step {self.step} ({why}); rank {self.rank} stops (exit {ABORT_EXIT}). Continue the run with resume=last"
