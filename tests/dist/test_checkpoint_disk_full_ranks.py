"""A write that fails on one rank of a save (a full disk under that rank's files) ends the save on
every rank with the same one-line error, in time, with the ``.tmp`` directory removed: no rank
waits in a barrier for a rank that has given up."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from strategies.checkpoint import dcp as ckpt
from strategies.runtime.gloo import run_gloo_ranks


def _save_failing_on(root: Path, failing_rank: int, name: str) -> Any:
    """A rank's body: save step 1 intact, then step 2 with the file ``name`` (one this rank writes
    with ``torch.save``) raising ENOSPC on ``failing_rank`` only. Returns (error message, files
    left in ``root``)."""

    def rank_fn(rank: int) -> tuple[str, list[str]]:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        ckpt.save(root / "step_0000001", model=model, optimizers=[optimizer], meta={"global_step": 1})
        real = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if rank == failing_rank and isinstance(f, (str, os.PathLike)) and Path(f).name == name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            real(obj, f, *args, **kwargs)

        torch.save = save
        try:
            ckpt.save(root / "step_0000002", model=model, optimizers=[optimizer], meta={"global_step": 2})
        except ckpt.CheckpointWriteError as err:
            torch.distributed.barrier()  # every rank has raised: what rank 0 removed is gone
            return str(err), sorted(p.name for p in root.iterdir())
        finally:
            torch.save = real
        return "saved", sorted(p.name for p in root.iterdir())

    return rank_fn


@pytest.mark.parametrize("failing_rank, file", [(1, "rng/rank_00001.pt"), (0, ckpt.META_FILE)])
def test_one_rank_out_of_space_ends_the_save_on_every_rank(tmp_path: Path, failing_rank: int, file: str) -> None:
    by_rank = run_gloo_ranks(2, _save_failing_on(tmp_path, failing_rank, Path(file).name), timeout_s=60)
    messages = {message for message, _ in by_rank}
    assert len(messages) == 1, by_rank  # the same line on both ranks
    message = messages.pop()
    assert f"No space left on device (ENOSPC) writing {tmp_path / 'step_0000002.tmp' / file};" in message, message
    assert all(left == ["step_0000001"] for _, left in by_rank), by_rank
    assert ckpt.verify_checkpoint(tmp_path / "step_0000001") is None
