"""What a checkpoint save says when a file cannot be written: which file, why, and the space it needed.

A full disk (ENOSPC) in the middle of a save used to end a run with DCP's 100-line traceback;
`strategies.checkpoint.dcp.save` catches the OSError with `attempt_write`, removes its partial
``.tmp`` directory and raises one line made by `write_failure_line`.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException


def attempt_write(write: Callable[..., None], *args: Any) -> OSError | None:
    """Runs ``write(*args)``; the OSError it (or DCP, wrapping it) raised, or None.

    Raises:
        CheckpointException: DCP failed for another reason than an OSError (re-raised as it was).
    """
    try:
        write(*args)
    except (OSError, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        causes = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        found = next((c for c in causes if isinstance(c, OSError)), None)
        if found is None:
            raise
        return found
    return None


def write_failure_line(path: Path, err: OSError, needed: int) -> str:
    """One line: which file of the save of ``path`` failed, why, and (disk full) the space it needed.

    Args:
        path: the checkpoint directory the save was making (it wrote into ``<path>.tmp``).
        err: the write's error (its errno and file name are reported).
        needed: bytes of the whole state over all ranks, about what the checkpoint takes.
    """
    code = errno.errorcode.get(err.errno or 0, "unknown errno")
    where = err.filename or path.with_name(path.name + ".tmp")
    line = f"not saving {path.name}: {err.strerror or err} ({code}) writing {where}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(path.parent).free
        line += (
            f"; the checkpoint needs about {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free in {path.parent}"
        )
    return line + (
        "; its partial files are removed and the checkpoints already written are kept: free space (or point "
        "run_dir elsewhere) and run again with resume=last"
    )
