"""Asynchronous checkpoint saves (strategies/checkpoint/async_save.py, callbacks.checkpoint.async_save).

A background save writes the checkpoint a synchronous one writes, of the state at the moment of the
save (the next steps change the live state while it is written); it is complete (manifest, no
``.tmp``) only once finished; a second save finishes the first before it starts; and a save still
in flight at the end of training is finished by it, with ``last`` moved to it.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import compose_config, fit
from torch import nn

from strategies.checkpoint import async_save
from strategies.checkpoint import dcp as ckpt
from strategies.checkpoint.async_save import AsyncWriter
from trainer.callbacks.checkpoint import PeriodicCheckpoint
from trainer.off_step import OffStepClock

TASK = SimpleNamespace(off_step=OffStepClock())  # the Task's clock of the saves (summary.json's tokens/s)


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _loaded(path: Path) -> dict[str, Any]:
    """Model and optimizer state, RNG state and meta of the checkpoint ``path``, loaded into a fresh model."""
    model, optimizer = _trained(seed=1)  # other values: everything compared comes from the checkpoint
    meta = ckpt.load(path, model=model, optimizers=[optimizer])
    rng = torch.load(path / "rng" / "rank_00000.pt", weights_only=True)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"], "rng": rng, "meta": meta}


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_a_background_save_writes_the_state_of_its_moment(tmp_path: Path) -> None:
    model, optimizer = _trained()
    meta = {"global_step": 3}
    torch.manual_seed(7)
    ckpt.save(tmp_path / "sync", model=model, optimizers=[optimizer], meta=meta)
    writer = AsyncWriter()
    torch.manual_seed(7)  # the same RNG state at both saves
    ckpt.save(tmp_path / "async", model=model, optimizers=[optimizer], meta=meta, writer=writer)
    assert writer.pending and not ckpt.is_checkpoint(tmp_path / "async")  # not complete before it is finished
    with torch.no_grad():  # the next step changes the live state during the write: the copy was taken
        for p in model.parameters():
            p.add_(1.0)
    assert writer.finish() == tmp_path / "async"
    writer.close()
    assert ckpt.verify_checkpoint(tmp_path / "async") is None and not (tmp_path / "async.tmp").exists()
    _assert_same(_loaded(tmp_path / "async"), _loaded(tmp_path / "sync"))


def test_a_second_save_finishes_the_first_before_it_starts(tmp_path: Path, monkeypatch) -> None:
    model, optimizer = _trained()
    release = threading.Event()
    hash_files = async_save.hash_files

    def slow_hash(root: Path, names: list[str]) -> Any:  # the first background write stays in flight
        release.wait(timeout=30)
        return hash_files(root, names)

    monkeypatch.setattr(async_save, "hash_files", slow_hash)
    writer = AsyncWriter()
    ckpt.save(tmp_path / "step_1", model=model, optimizers=[optimizer], meta={"global_step": 1}, writer=writer)
    assert not writer.all_written()
    threading.Timer(0.3, release.set).start()
    ckpt.save(tmp_path / "step_2", model=model, optimizers=[optimizer], meta={"global_step": 2}, writer=writer)
    # The first is complete now (the second waited for its write); the second is in flight.
    assert ckpt.verify_checkpoint(tmp_path / "step_1") is None
    assert writer.path == tmp_path / "step_2" and not ckpt.is_checkpoint(tmp_path / "step_2")
    writer.finish()
    writer.close()
    assert ckpt.verify_checkpoint(tmp_path / "step_2") is None


def _trainer(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """What `PeriodicCheckpoint` uses of a one-process trainer; its saves go through `ckpt.save`."""
    strategy = SimpleNamespace(broadcast=lambda value: value, barrier=lambda: None)
    trainer = SimpleNamespace(
        global_step=step,
        is_global_zero=True,
        loggers=[],
        strategy=strategy,
        lightning_module=None,
        max_steps=-1,
        should_stop=False,
    )

    def save_checkpoint(path: Path, weights_only: bool, storage_options: Any = None) -> None:
        meta = {"global_step": trainer.global_step}
        ckpt.save(path, model=model, optimizers=[optimizer], meta=meta, writer=storage_options)

    trainer.save_checkpoint = save_checkpoint
    return trainer


def test_the_end_of_training_finishes_the_save_in_flight(tmp_path: Path) -> None:
    callback = PeriodicCheckpoint(dirpath=str(tmp_path), every_n_steps=2, save_on_signal=False, async_save=True)
    trainer = _trainer(2, *_trained())
    callback.on_train_batch_start(trainer, None)
    callback.on_train_batch_end(trainer, TASK)  # step 2: a background save starts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000002.tmp"]
    callback.on_train_end(trainer, None)
    callback.teardown(trainer, None, "fit")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step_0000002"]
    assert (tmp_path / "last").readlink() == Path("step_0000002")
    assert ckpt.verify_checkpoint(tmp_path / "step_0000002") is None


def test_the_last_step_is_saved_complete_at_its_end_of_step(tmp_path: Path) -> None:
    """The step a run ends at (trainer.max_steps, or a stop a callback asked for) is saved in the
    step, synchronously (before Lightning closes the epoch and before the run's end hooks)."""
    for ask in ("max_steps", "should_stop"):
        dirpath = tmp_path / ask
        callback = PeriodicCheckpoint(dirpath=str(dirpath), every_n_steps=0, save_on_signal=False, async_save=True)
        trainer = _trainer(3, *_trained())
        if ask == "max_steps":
            trainer.max_steps = 3
        else:
            trainer.should_stop = True
        callback.on_train_batch_start(trainer, None)
        callback.on_train_batch_end(trainer, TASK)
        assert sorted(p.name for p in dirpath.iterdir()) == ["last", "step_0000003"], ask
        assert ckpt.verify_checkpoint(dirpath / "step_0000003") is None


@pytest.mark.slow
def test_a_run_ends_with_its_last_background_save_complete(tmp_path: Path) -> None:
    overrides = ["trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.async_save=true"]
    fit(compose_config(overrides), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last", "step_0000002"]
    assert (checkpoints / "last").readlink() == Path("step_0000002")
    assert ckpt.verify_checkpoint(checkpoints / "step_0000002") is None


def test_a_failed_background_write_ends_with_the_write_failure_line(tmp_path: Path, monkeypatch) -> None:
    model, optimizer = _trained()
    writer = AsyncWriter()
    ckpt.save(tmp_path / "step_1", model=model, optimizers=[optimizer], meta={"global_step": 1}, writer=writer)

    def full_disk(state: Any, **kwargs: Any) -> Future:
        (kwargs["checkpoint_id"] / "__0_0.distcp").write_bytes(b"partial")
        failed: Future = Future()
        failed.set_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(kwargs["checkpoint_id"])))
        return failed

    monkeypatch.setattr(async_save.dcp, "async_save", full_disk)
    ckpt.save(tmp_path / "step_2", model=model, optimizers=[optimizer], meta={"global_step": 2}, writer=writer)
    with pytest.raises(ckpt.CheckpointWriteError, match="not saving step_2: .*ENOSPC.*checkpoints already written"):
        writer.finish()
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # its .tmp removed, step_1 kept
    assert ckpt.verify_checkpoint(tmp_path / "step_1") is None
