"""`strategies.runtime.launch.RankObserver`: after a child rank exits non-zero, the ranks get ``grace_s`` to
end on their own, then the rest are killed and rank 0 ends with one line naming the lost rank and
exit 4 (Lightning's observer SIGKILLs every rank at once, rank 0 included, with no plait line)."""

from __future__ import annotations

import subprocess
import time

from strategies.runtime.launch import RankObserver


def test_a_failed_child_rank_ends_the_others_after_the_grace_with_one_line(capsys) -> None:
    procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sh", "-c", "sleep 0.2; kill -9 $$"])]
    ended: list[tuple[int, float]] = []
    start = time.monotonic()
    observer = RankObserver(
        procs, grace_s=1.5, step=lambda: 7, poll_s=0.1, end=lambda code: ended.append((code, time.monotonic() - start))
    )
    observer.start()
    observer.join(timeout=30)
    assert ended and ended[0][0] == 4 and ended[0][1] >= 0.2 + 1.5, ended  # the grace was given
    assert procs[0].wait(timeout=5) == -9  # the survivor that did not end on its own
    assert capsys.readouterr().err.strip() == (
        "plait: error: lost rank 2 at step 7 (its process was killed by SIGKILL); rank 0 stops the run (exit 4). "
        "Continue it with resume=last"
    )


def test_ranks_that_all_end_cleanly_end_nothing() -> None:
    procs = [subprocess.Popen(["true"]), subprocess.Popen(["sh", "-c", "sleep 0.3"])]
    ended: list[int] = []
    observer = RankObserver(procs, grace_s=0.1, poll_s=0.1, end=ended.append)
    observer.start()
    observer.join(timeout=30)
    assert not observer.is_alive() and ended == []
